"""What the open-loop client drives: the engine in this process, or a deployment through the public gRPC API.

- ``in-process``: an ``Engine`` started in this process (weights shared between the modes' engines), driven
  through ``Engine.open_stream``; queue counters from ``engine.stats()``.
- ``deployment``: a fresh process tree (``services.launcher.serve_all``: three stage servers and the scheduler
  service) per mode, driven by ``clients.async_client.AsyncClient`` streaming calls; queue counters from ``Info``.

Both serve with ``allow_replay_depths`` and ``ignore_eos``: a request emits exactly its drawn length, at its
replayed depths when it carries them (full-depth mode serves every token at max depth regardless).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Protocol

from cdb_bench.serve.driver import Connection
from cdb_bench.serve.requests import ServeRequest
from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.events import TokenEvent
from cdb_engine.inprocess import shared_model_factory
from cdb_model.base import LoopedLM
from cdb_scheduler.plan import SamplingParams
from cdb_scheduler.request import FinishReason
from clients.async_client import AsyncClient
from clients.common import GenerateOptions, StreamToken
from services.launcher import serve_all

TARGETS = ("in-process", "deployment")
_DONE = (FinishReason.LENGTH, FinishReason.STOP)


class Target(Protocol):
    async def connect(self) -> Connection:
        """A connection for one run, made on the run's event loop."""
        ...

    async def disconnect(self, conn: Connection) -> None: ...


def _params(req: ServeRequest) -> RequestParams:
    return RequestParams(
        max_tokens=req.max_tokens, sampling=SamplingParams(), ignore_eos=True, replay_depths=req.replay_depths
    )


class InProcessConnection:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def stream(self, req: ServeRequest) -> AsyncIterator[int]:
        params = _params(req)
        ids = self.engine.validate(list(req.prompt), params)
        async with self.engine.open_stream(ids, params) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    yield ev.depth
                elif ev.finish_reason not in _DONE:
                    raise RuntimeError(f"finished with {ev.finish_reason}: {ev.error or ''}")

    async def queue(self) -> tuple[int, int]:
        s = self.engine.stats()
        return s.waiting, s.running


class InProcessTarget:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def connect(self) -> Connection:
        return InProcessConnection(self.engine)

    async def disconnect(self, conn: Connection) -> None:
        return None


class DeploymentConnection:
    def __init__(self, address: str, timeout: float) -> None:
        self.client = AsyncClient(address, timeout=timeout)

    async def stream(self, req: ServeRequest) -> AsyncIterator[int]:
        opts = GenerateOptions(max_tokens=req.max_tokens, ignore_eos=True)
        if req.replay_depths is not None:
            opts["replay_depths"] = req.replay_depths
        async for item in self.client.stream(list(req.prompt), **opts):
            if isinstance(item, StreamToken):
                yield item.depth
            elif item.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"finished with {item.finish_reason}: {item.error}")

    async def queue(self) -> tuple[int, int]:
        counters = (await self.client.info()).counters
        return counters["waiting"], counters["running"]


class DeploymentTarget:
    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout

    async def connect(self) -> Connection:
        conn = DeploymentConnection(self.address, self.timeout)
        await conn.queue()  # the channel is connected before the first arrival
        return conn

    async def disconnect(self, conn: Connection) -> None:
        assert isinstance(conn, DeploymentConnection)
        await conn.client.close()


@contextmanager
def open_target(
    kind: str, cfg: EngineConfig, *, model: LoopedLM | None, max_live: int, timeout: float = 600.0
) -> Iterator[Target]:
    """Start the target for one mode; ``max_live``: requests that may be in the system at once (the waiting
    queue and the public server's RPC cap are raised to hold them all: overload shows as latency, not refusal)."""
    cfg = replace(cfg, allow_replay_depths=True, max_waiting=max(cfg.max_waiting, max_live))
    if kind == "in-process":
        engine = Engine(cfg, shared_model_factory(model) if model is not None else None).start()
        try:
            yield InProcessTarget(engine)
        finally:
            engine.shutdown()
        return
    if kind != "deployment":
        raise ValueError(f"target must be one of {', '.join(TARGETS)}; got {kind!r}")
    env = dict(os.environ)
    env["CDB_MAX_CONCURRENT_RPCS"] = str(max(int(env.get("CDB_MAX_CONCURRENT_RPCS", "1024")), max_live + 64))
    with serve_all(cfg, "127.0.0.1:0", env=env) as tree:
        yield DeploymentTarget(tree.address, timeout)
