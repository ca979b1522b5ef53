"""The HTTP API on a real uvicorn server (127.0.0.1, port 0) over an in-process engine, on its own event loop thread.

``served(config)`` starts the engine, the public ``FrontDoor`` with its readiness check, and
``serve_http(create_app(...))`` as the scheduler does, and stops them on exit. ``GatedExecutor`` holds every stage
op until its gate opens: requests are admitted (and counted) but make no progress, which makes overload, drain
and disconnect tests deterministic.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import openai
import uvloop

from cdb_engine.client import InProcessClient
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine
from cdb_engine.inprocess import InProcessExecutor
from cdb_engine.setup import StageSetup
from cdb_scheduler.plan import StageLoss, StageOp, StageResult
from services.api.door import FrontDoor
from services.api.readiness import Readiness
from services.http.app import create_app
from services.http.server import serve_http
from services.settings import Settings

SETTINGS = Settings(health_interval_s=0.05)
TINY = EngineConfig(
    model="ouro-tiny", max_num_seqs=4, num_kv_blocks=256, max_input_tokens=200, max_total_tokens=400, num_threads=1
)


class GatedExecutor:
    """An in-process executor whose ``submit`` waits until ``gate`` is set (the engine thread stalls there)."""

    concurrent_stages = False

    def __init__(self, setup: StageSetup) -> None:
        self.inner = InProcessExecutor(setup, num_threads=1)
        self.gate = threading.Event()

    def submit(self, op: StageOp) -> None:
        self.gate.wait()
        self.inner.submit(op)

    def poll(self, timeout: float | None) -> StageResult | StageLoss | None:
        return self.inner.poll(timeout)

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.gate.set()
        self.inner.close()


@dataclass
class Served:
    engine: Engine
    door: FrontDoor
    address: str
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    stop_event: asyncio.Event
    gate: threading.Event | None = None
    keys: list[str] = field(default_factory=list)

    def stop(self) -> None:
        """Ask ``serve_http`` to stop (it returns once uvicorn's graceful shutdown is over)."""
        self.loop.call_soon_threadsafe(self.stop_event.set)

    scheme: str = "http"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.address}/v1"

    def client(self, api_key: str | None = None, **kw: Any) -> openai.OpenAI:
        key = api_key if api_key is not None else (self.keys[0] if self.keys else "none")
        kw.setdefault("base_url", self.base_url)
        return openai.OpenAI(api_key=key, max_retries=0, timeout=60, **kw)

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's event loop (where the door's state lives) and return its result."""

        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(30)

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """One plain HTTP request with a JSON ``body`` (or ``raw`` bytes): status, lower-cased headers, body."""
        host, port = self.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 30.0, interval: float = 0.005) -> None:
    """Poll a condition of the system under test until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


@contextmanager
def served(
    config: EngineConfig = TINY,
    *,
    start_engine: bool = True,
    gated: bool = False,
    api_keys: Collection[str] | None = None,
    settings: Settings = SETTINGS,
    shutdown_timeout_s: float = 5.0,
) -> Iterator[Served]:
    executors: list[GatedExecutor] = []

    def gated_factory(setup: StageSetup) -> GatedExecutor:
        executors.append(GatedExecutor(setup))
        return executors[-1]

    engine = Engine(config, executor_factory=gated_factory if gated else None)
    if start_engine:
        engine.start()
    loop = uvloop.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        try:
            await serve()
        except BaseException as exc:
            box["error"] = exc
            ready.set()
            raise

    async def serve() -> None:
        door = FrontDoor(InProcessClient(engine), settings)
        readiness = Readiness(door, None, settings)
        watcher = asyncio.create_task(readiness.run())
        stop, bound = asyncio.Event(), asyncio.Event()

        def on_bound(address: str) -> None:
            box["address"] = address
            bound.set()

        app = create_app(door, settings, api_keys=api_keys)
        serving = asyncio.create_task(
            serve_http(
                app,
                "127.0.0.1:0",
                settings=settings,
                on_bound=on_bound,
                stop=stop,
                shutdown_timeout_s=shutdown_timeout_s,
            )
        )
        await bound.wait()
        if start_engine:
            await readiness.first_ready.wait()
        box.update(door=door, stop=stop)
        ready.set()
        try:
            await serving
        finally:
            watcher.cancel()
            await readiness.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), name="http-api", daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "the HTTP API did not start"
        if "error" in box:
            raise box["error"]
        gate = executors[0].gate if executors else None
        scheme = "https" if settings.tls_cert else "http"
        yield Served(engine, box["door"], box["address"], loop, thread, box["stop"], gate, list(api_keys or ()), scheme)
    finally:
        for ex in executors:
            ex.gate.set()
        if "stop" in box:
            loop.call_soon_threadsafe(box["stop"].set)
        thread.join(30)
        assert not thread.is_alive(), "the HTTP server did not stop"
        loop.close()
        if start_engine:
            engine.shutdown()
