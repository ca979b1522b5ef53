# syntax=docker/dockerfile:1
# One image for the whole process tree. Its entrypoint serves: `cdb serve` runs the scheduler and the three stage
# servers in this one container, on the shipped model (ouro-kjv) unless a model is given, and the arguments of
# `docker run IMAGE ...` pass through to it as vLLM's image does; docker-compose.yml and the Kubernetes manifests
# (deploy/k8s) instead run each process in a container of its own (`cdb stage` / `cdb scheduler`, their own
# entrypoint and command).
#   docker build -t cdb:latest .                                    CPU torch (default)
#   docker build -t cdb:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --init --shm-size 1g -p 127.0.0.1:50051:50051 -p 127.0.0.1:8000:8000 cdb:latest
#   docker run --init --gpus all --shm-size 8g -p 127.0.0.1:8000:8000 -v ~/.cache/huggingface:/models/hf:ro \
#       cdb:gpu ByteDance/Ouro-1.4B --max-model-len 8192      a model from the host's Hugging Face cache
# Inside the container it listens on 0.0.0.0; what the host publishes decides the exposure (keep 127.0.0.1 unless
# TLS or API keys are configured: CDB_TLS_CERT/CDB_TLS_KEY, CDB_API_KEYS_FILE). With --read-only, also pass
# --tmpfs /tmp: `cdb serve` keeps its sockets and stage secret in a private folder there.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS base

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
    && python -c "import cdb.processes, services.api.server, services.transport.stage_server, services.healthcheck"

# The scheduler compiled with mypyc (cdb_scheduler/_native.py), in a stage of its own: the compiler and mypy stay
# out of the image, only the built modules come over (they are used while they match the installed sources).
FROM base AS native
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && pip install "mypy==2.4.1" "setuptools>=68" \
    && cdb native build \
    && cp -r "$(python -c 'from cdb_scheduler import _native; print(_native.BUILD)')" /native

FROM base
COPY --from=native /native /tmp/native
RUN mv /tmp/native "$(python -c 'from cdb_scheduler import _native; print(_native.BUILD)')" \
    && cdb native status | grep -q "compiled (mypyc)"

# A numeric user (Kubernetes' runAsNonRoot can check it) and the paths it writes besides /tmp and /dev/shm:
# /models is where checkpoint folders are mounted (CDB_MODEL=/models/NAME); /var/lib/cdb/secret is where
# compose's stage-secret volume is mounted, /var/lib/cdb/link its front-end link volume
# (deploy/docker-compose.frontends.yml); a new named volume takes its folder's owner and mode.
RUN groupadd --gid 10001 cdb \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin cdb \
    && mkdir -p /models /var/lib/cdb/secret /var/lib/cdb/link \
    && chown 10001:10001 /models /var/lib/cdb /var/lib/cdb/secret /var/lib/cdb/link \
    && chmod 0700 /var/lib/cdb/secret /var/lib/cdb/link
USER 10001:10001

# The scheduler's OpenAI-compatible HTTP API (the stages ignore it).
ENV CDB_HTTP_ADDR=0.0.0.0:8000

# 50051: public gRPC API; 8000: OpenAI-compatible HTTP API; 9464: Prometheus metrics (all the scheduler's).
EXPOSE 50051 8000 9464

# The Hugging Face cache, mounted read-only (models are never downloaded): `cdb serve ORG/NAME` finds them here.
ENV HF_HOME=/models/hf

ENTRYPOINT ["python", "-m", "cdb", "serve", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:9464"]
CMD []

# Ready: the scheduler's grpc.health.v1 says SERVING (a first start loads the model: a long start period).
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-m", "services.healthcheck", "127.0.0.1:50051", "--timeout", "3"]
