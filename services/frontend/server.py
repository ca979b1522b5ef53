"""``cdb frontend``: a front-end process. It serves the public gRPC API (and the HTTP API when configured) over the
engine of the scheduler process, reached through the front-end link (``services.transport.frontlink``).

Everything a public call does that is not planning happens here: authentication, fair shares and call caps,
validation and tokenization, the request's metrics (relayed to the scheduler's registry) and span, streaming and
its encoding, draining. The readiness a front end reports is the scheduler's (relayed with the link's status
frames), or NOT_SERVING while the link is down. ``CDB_FRONTENDS`` > 1: the front ends share the public ports
(``SO_REUSEPORT``; the kernel spreads connections over them).
"""

from __future__ import annotations

import functools
import logging
from typing import cast

import grpc

from cdb_api.v1 import generation_pb2 as pb
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine
from services import heap, telemetry
from services.frontend.remote import LinkClient, MetricsRelay, RemoteEngine
from services.http import serve_api
from services.scheduler.errors import mapped_errors
from services.scheduler.handlers import GenerationService
from services.scheduler.readiness import Readiness
from services.scheduler.security import PortSecurity
from services.scheduler.server import FrontEnd, event_loop_runner, serve
from services.settings import Settings
from services.stage_secret import load_stage_secret
from services.telemetry.metrics import Metrics
from services.transport.frontlink import socket_path

log = logging.getLogger("cdb.frontend")


class FrontendService(GenerationService):
    """``cdb.v1.Generation`` in a front-end process: the handlers as in the scheduler, ``Info`` asked of it."""

    def __init__(self, engine: RemoteEngine, settings: Settings, relay: MetricsRelay, security: PortSecurity) -> None:
        super().__init__(cast(Engine, engine), None, settings, cast(Metrics, relay), None, auth=security.auth)
        self.remote = engine
        self.deployment = "microservices"

    @mapped_errors
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return pb.InfoResponse.FromString(await self.remote.link.ask("info"))


class LinkReadiness(Readiness):
    """The scheduler's readiness verdict, as its status frames carry it (NOT_SERVING while the link is down)."""

    def __init__(self, service: FrontendService, link: LinkClient, settings: Settings) -> None:
        super().__init__(service, None, settings)
        self.link = link

    async def check(self) -> str | None:
        return self.link.reason


def run_frontend(
    config: EngineConfig,
    listen: str,
    link: str,
    settings: Settings,
    *,
    ready_file: str | None = None,
    http: str | None = None,
    join: bool = False,
) -> None:
    """Serve the public API on ``listen`` (and HTTP on ``http``) over the scheduler behind ``link`` until
    SIGTERM/SIGINT, then drain. ``join``: another front end listens on these ports already."""
    telemetry.init_tracing("cdb-frontend")
    client = LinkClient(socket_path(link), load_stage_secret(settings)).start()
    relay = MetricsRelay(client)
    try:
        engine = RemoteEngine(config, client)
        security = PortSecurity.from_settings(settings)
        service = FrontendService(engine, settings, relay, security)
        readiness = LinkReadiness(service, client, settings)
        shared = settings.frontends > 1
        front = FrontEnd(service, readiness, reuse_port=shared, join=join)
        companion = functools.partial(serve_api, address=http, reuse_port=shared) if http else None
        heap.settle()  # what startup loaded stays: no collection scans it while streaming
        with event_loop_runner(settings) as runner:
            runner.run(
                serve(
                    cast(Engine, engine),
                    None,
                    None,
                    listen,
                    settings,
                    ready_file,
                    companion=companion,
                    front=front,
                )
            )
    finally:
        relay.close()
        client.close()
        telemetry.shutdown_tracing()
