# syntax=docker/dockerfile:1
# One image for the scheduler and the three stage servers (docker-compose.yml picks the command).
#   docker build -t cdb:latest .                                    CPU torch (default)
#   docker build -t cdb:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VERSION=2.13.0
# The CPU wheel index keeps the image small (the default PyPI torch pulls the CUDA libraries).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app

# torch first, in its own layer: it is by far the largest and changes least often.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The project (generated gRPC stubs are committed under cdb_api/, so no protoc step is needed).
COPY . /app
RUN pip install /app \
    && python -c "import cdb.processes, services.scheduler.server, services.transport.stage_server, services.healthcheck"

# Checkpoint folders are mounted here (CDB_MODEL=/models/NAME); presets such as ouro-tiny need no files.
RUN useradd --create-home --uid 10001 cdb && mkdir -p /models && chown cdb /models
USER cdb

# 50051: public gRPC API (scheduler); 9464: Prometheus metrics (scheduler, CDB_METRICS_ADDR).
EXPOSE 50051 9464

CMD ["python", "-m", "cdb", "scheduler", "--help"]
