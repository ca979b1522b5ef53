"""``cdb frontend``: a front-end process. It serves the public gRPC API (and the HTTP API when configured) over the
engine of the scheduler process, reached through the front-end link (``services.frontlink.wire``).

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

from cdb_api.v1 import generation_pb2 as pb
from cdb_engine.config import EngineConfig
from cdb_engine.prepare import RequestPreparer
from services import heap, telemetry
from services.api.door import FrontDoor
from services.api.handlers import GenerationService
from services.api.readiness import Readiness
from services.api.security import PortSecurity
from services.api.server import FrontEnd, event_loop_runner, serve
from services.frontlink.client import LinkClient, MetricsRelay, RemoteClient
from services.frontlink.messages import AskInfo
from services.frontlink.wire import socket_path
from services.http import serve_api
from services.settings import Settings
from services.stage_secret import load_link_secret
from services.telemetry.metrics import Metrics

log = logging.getLogger("cdb.frontend")


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
    client = LinkClient(socket_path(link), load_link_secret(settings), settings.link_timeout_s).start()
    relay = MetricsRelay(client)  # request metrics go to the scheduler's registry, which also answers /metrics
    try:
        security = PortSecurity.from_settings(settings)
        engine = RemoteClient(RequestPreparer.of(config), client)  # requests are prepared here
        door = FrontDoor(engine, settings, cast(Metrics, relay), auth=security.auth, exposition=relay.exposition)

        async def info() -> pb.InfoResponse:
            return pb.InfoResponse.FromString(await client.ask(AskInfo(0)))

        shared = settings.front_ends() > 1
        service = GenerationService(door, info, "microservices")
        front = FrontEnd(service, Readiness(door, None, settings), reuse_port=shared, join=join)
        companion = functools.partial(serve_api, address=http, reuse_port=shared) if http else None
        heap.settle()  # what startup loaded stays: no collection scans it while streaming
        with event_loop_runner(settings) as runner:
            runner.run(serve(front, listen, settings, ready_file, companion=companion))
    finally:
        relay.close()
        client.close()
        telemetry.shutdown_tracing()
