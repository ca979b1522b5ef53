"""The public server (``build_server`` + ``listen_on``, as ``serve`` builds it) over an in-process engine on the
tiny model, on a background event loop, for tests of the public port: TLS, API keys, scoping, decoding, limits."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import pytest

from cdb_engine.client import InProcessClient
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine
from services.api.door import FrontDoor
from services.api.handlers import GenerationService
from services.api.info import EngineInfo
from services.api.readiness import Readiness
from services.api.security import PortSecurity
from services.api.server import build_server
from services.net import listen_on
from services.settings import Settings

TINY = EngineConfig(model="ouro-tiny", max_num_seqs=4, num_kv_blocks=256, max_total_tokens=1024, max_waiting=16)


@contextmanager
def tiny_engine(config: EngineConfig = TINY) -> Iterator[Engine]:
    engine = Engine(config).start()
    try:
        yield engine
    finally:
        engine.shutdown()


@dataclass(frozen=True)
class PublicServer:
    address: str  # 127.0.0.1:PORT
    port: int
    service: GenerationService
    security: PortSecurity

    @property
    def door(self) -> FrontDoor:
        return self.service.door


@contextmanager
def public_server(engine: Engine, settings: Settings | None = None) -> Iterator[PublicServer]:
    """Serve ``engine`` on ``127.0.0.1:0`` with ``settings``' public-port options until the block ends."""
    settings = settings or Settings(health_interval_s=0.05)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="public-server", daemon=True)
    thread.start()

    async def start() -> tuple[PublicServer, grpc.aio.Server, Readiness, asyncio.Task[None]]:
        security = PortSecurity.from_settings(settings)
        door = FrontDoor(InProcessClient(engine), settings, auth=security.auth)
        info = EngineInfo(engine, door)
        service = GenerationService(door, info, info.deployment)
        readiness = Readiness(door, None, settings)
        server = build_server(service, readiness, settings, security)
        port = listen_on(server, "127.0.0.1:0", security.credentials)
        await server.start()
        watcher = asyncio.create_task(readiness.run())
        await readiness.first_ready.wait()
        return PublicServer(f"127.0.0.1:{port}", port, service, security), server, readiness, watcher

    try:
        running, server, readiness, watcher = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
        raise

    async def stop() -> None:
        watcher.cancel()
        await server.stop(None)
        await readiness.close()

    try:
        yield running
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def assert_no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing at ERROR or above, and no traceback, was logged (gRPC's own logger included)."""
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [f"{r.name}: {r.getMessage()}" for r in bad]
