"""One stage process: loads only its stage's weights and serves ``cdb.v1.Stage`` (``StageService``) and health.

Run: ``cdb stage --role loop --listen 127.0.0.1:50062 --model ouro-tiny``.

Tracing (``OTEL_*`` environment, service ``cdb-<role>``): a ``batch <role>`` span per executed batch, linked to
the requests it served (``services.telemetry.StageTracer``); off by default, and then not a call per batch.

Lifecycle: load weights -> listen (loopback or a Unix socket only) -> health SERVING -> SIGTERM/SIGINT: stop.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_engine.setup import torch_dtype
from cdb_model.loader import load_model
from cdb_scheduler.plan import Stage
from services import telemetry
from services.net import bound_address, require_loopback, write_ready_file
from services.settings import Settings, load_settings
from services.transport.stage_service import StageService

log = logging.getLogger("cdb.stage")

# The scheduler's channels send keepalive pings to detect a frozen stage, also while a stream carries no data;
# by default a server answers such pings with GOAWAY "too many pings", which would break an idle Run stream.
SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def build_server(service: StageService, listen: str, max_workers: int = 8) -> tuple[grpc.Server, int]:
    """A sync gRPC server with the stage, health and reflection services; returns (server, bound port)."""
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="cdb-stage-rpc")
    server = grpc.server(pool, options=SERVER_OPTIONS)
    stage_pb2_grpc.add_StageServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Stage"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(require_loopback(listen))
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    for name in ("", names[0]):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port


def run_stage(
    role: str,
    model: str,
    listen: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    ready_file: str | None = None,
    settings: Settings | None = None,
) -> None:
    """Load ``role``'s weights of ``model``, serve until SIGTERM/SIGINT. Writes the bound address to
    ``ready_file`` (atomically) once serving."""
    settings = settings or load_settings()
    stage = Stage.from_role(role)
    require_loopback(listen)
    telemetry.init_tracing(f"cdb-{role}")
    try:
        torch.set_num_threads(settings.stage_threads)
        lm = load_model(model, dtype=torch_dtype(dtype), device=device, stages={stage})
        observer = telemetry.StageTracer(role) if telemetry.enabled() else None  # off: not even a call per batch
        service = StageService(stage, model, dtype, lm, settings, observer=observer)
        server, port = build_server(service, listen)
        address = bound_address(listen, port)
        log.info("%s stage of %s serving on %s", role, model, address)
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        if ready_file:
            write_ready_file(ready_file, address)
        done.wait()
        server.stop(grace=1.0).wait()
        service.close()
    finally:
        telemetry.shutdown_tracing()
