"""One stage process: loads only its stage's weights and serves ``cdb.v1.Stage`` (``StageService``) and health.

Run: ``cdb stage --role loop --listen 127.0.0.1:50062 --model ouro-tiny``.

Tracing (``OTEL_*`` environment, service ``cdb-<role>``): a ``batch <role>`` span per executed batch, linked to
the requests it served (``services.telemetry.StageTracer``); off by default, and then not a call per batch.

Lifecycle: load weights -> listen (loopback or a Unix socket only) -> health SERVING -> SIGTERM/SIGINT: stop.

Admission: every ``cdb.v1.Stage`` RPC must carry the deployment's stage secret (``services.stage_secret``);
a call without it, or with a wrong one, gets ``UNAUTHENTICATED`` and changes nothing. ``grpc.health.v1`` is
open (orchestrators probe it without credentials); no reflection is served.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cdb_api.v1 import stage_pb2 as pb
from cdb_api.v1 import stage_pb2_grpc
from cdb_engine.memory import stage_weights
from cdb_engine.setup import torch_dtype
from cdb_engine.stage_worker import StageWorker
from cdb_engine.synthetic import SyntheticWorker, synthetic_model
from cdb_model.loader import load_config, load_model
from cdb_scheduler.plan import Stage
from services import heap, telemetry
from services.net import NO_REUSEPORT, bound_address, listen_on, require_loopback, write_ready_file
from services.settings import Settings, load_settings
from services.stage_secret import load_stage_secret, secret_matches
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
    *NO_REUSEPORT,  # a second server on a busy address fails instead of sharing it
]

_STAGE_METHODS = "/" + pb.DESCRIPTOR.services_by_name["Stage"].full_name + "/"


class StageAuth(grpc.ServerInterceptor):
    """Admits a ``cdb.v1.Stage`` call only with the stage secret; other services (health) pass."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or not details.method.startswith(_STAGE_METHODS):
            return handler
        if secret_matches(self._secret, details.invocation_metadata):
            return handler

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong stage secret")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def build_server(service: StageService, listen: str, secret: str, max_workers: int = 8) -> tuple[grpc.Server, int]:
    """A sync gRPC server with the stage and health services, admitting only ``secret``'s holders; returns
    (server, bound port)."""
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="cdb-stage-rpc")
    server = grpc.server(pool, options=SERVER_OPTIONS, interceptors=[StageAuth(secret)])
    stage_pb2_grpc.add_StageServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = listen_on(server, require_loopback(listen))
    server.start()
    for name in ("", pb.DESCRIPTOR.services_by_name["Stage"].full_name):
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
    synthetic_cost: str = "",
    synthetic_depths: str = "",
    config_digest: str = "",
) -> None:
    """Load ``role``'s weights of ``model``, serve until SIGTERM/SIGINT. Writes the bound address to
    ``ready_file`` (atomically) once serving. With ``synthetic_cost`` the stage loads no weights: it models the
    device time of its ops (``cdb_engine.synthetic``). ``config_digest``: of the process's resolved configuration
    (``Configure`` reports it)."""
    settings = settings or load_settings()
    stage = Stage.from_role(role)
    require_loopback(listen)
    secret = load_stage_secret(settings)  # before loading weights: a missing secret fails in one line
    telemetry.init_tracing(f"cdb-{role}")
    try:
        torch.set_num_threads(settings.stage_threads)
        observer = telemetry.StageTracer(role) if telemetry.enabled() else None  # off: not even a call per batch
        if synthetic_cost:
            synth = synthetic_model(load_config(model), synthetic_cost, synthetic_depths, device, torch_dtype(dtype))
            service = StageService(stage, model, dtype, synth, settings, SyntheticWorker, observer, config_digest)
            what = f"SYNTHETIC {role} stage (modelled device time {synth.cost.describe()}; its tokens mean nothing)"
        else:
            stages = stage_weights(stage, load_config(model))
            lm = load_model(model, dtype=torch_dtype(dtype), device=device, stages=stages)
            worker = functools.partial(StageWorker, decode_graphs=None if settings.cuda_graphs else False)
            service = StageService(stage, model, dtype, lm, settings, worker, observer, config_digest)
            what = f"{role} stage"
        server, port = build_server(service, listen, secret)
        address = bound_address(listen, port)
        log.info("%s of %s serving on %s", what, model, address)
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        heap.settle()  # the model, torch and the server stay: no collection scans them while serving
        if ready_file:
            write_ready_file(ready_file, address)
        done.wait()
        server.stop(grace=1.0).wait()
        service.close()
    finally:
        telemetry.shutdown_tracing()
