"""What the open-loop client drives: the engine in this process, or a deployment through the public gRPC API.

- ``in-process``: an ``Engine`` started in this process (weights shared between the modes' engines), driven
  through ``Engine.open_stream``; queue counters from ``engine.stats()``.
- ``deployment``: a fresh process tree (``services.launcher.serve_all``: three stage servers and the scheduler
  service) per mode, driven by ``clients.async_client.AsyncClient`` streaming calls; queue counters from ``Info``.

Each target also reads its op counters (``OpCounters``: ops and compute seconds per stage, decode loop ops and
their tokens) before and after a run, so a run reports what it cost op by op: in-process from the scheduler's
stats, through a deployment from the scheduler's Prometheus exposition (the same figures, summed by the stages'
own timers).

Both serve with ``allow_replay_depths`` and ``ignore_eos``: a request emits exactly its drawn length, at its
replayed depths when it carries them (full-depth mode serves every token at max depth regardless).
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families

from cdb_bench.processes import free_address, with_public_caps
from cdb_bench.serve.driver import Connection
from cdb_bench.serve.metrics import OpCounters
from cdb_bench.serve.requests import ServeRequest
from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_engine.events import TokenEvent
from cdb_engine.inprocess import shared_model_factory
from cdb_model.base import LoopedLM
from cdb_scheduler.plan import Stage
from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import SamplingParams
from clients.async_client import AsyncClient
from clients.messages import GenerateOptions, StreamToken
from services.launcher import serve_all

TARGETS = ("in-process", "deployment")
_DONE = (FinishReason.LENGTH, FinishReason.STOP)


class Target(Protocol):
    async def connect(self) -> Connection:
        """A connection for one run, made on the run's event loop."""
        ...

    async def disconnect(self, conn: Connection) -> None: ...

    def counters(self) -> OpCounters:
        """The op counters now (called between runs, off the run's event loop)."""
        ...


def _params(req: ServeRequest) -> RequestParams:
    return RequestParams(
        max_tokens=req.max_tokens, sampling=SamplingParams(), ignore_eos=True, replay_depths=req.replay_depths
    )


class InProcessConnection:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def stream(self, req: ServeRequest) -> AsyncIterator[int]:
        params = _params(req)
        ids = self.engine.validate(req.prompt_arg(), params)
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

    def counters(self) -> OpCounters:
        s = self.engine.sched_stats
        return OpCounters(
            {st.role: s.ops[st] for st in Stage},
            {st.role: s.compute_s[st] for st in Stage},
            s.loop_steps,
            s.loop_tokens,
            s.loop_decode_compute_s,
        )


class DeploymentConnection:
    def __init__(self, address: str, timeout: float) -> None:
        self.client = AsyncClient(address, timeout=timeout)

    async def stream(self, req: ServeRequest) -> AsyncIterator[int]:
        opts = GenerateOptions(max_tokens=req.max_tokens, ignore_eos=True)
        if req.replay_depths is not None:
            opts["replay_depths"] = req.replay_depths
        async for item in self.client.stream(req.prompt_arg(), **opts):
            if isinstance(item, StreamToken):
                yield item.depth
            elif item.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"finished with {item.finish_reason}: {item.error}")

    async def queue(self) -> tuple[int, int]:
        counters = (await self.client.info()).counters
        return counters["waiting"], counters["running"]


class DeploymentTarget:
    def __init__(self, address: str, timeout: float, metrics: str) -> None:
        self.address = address
        self.timeout = timeout
        self.metrics = metrics  # the scheduler's Prometheus endpoint, HOST:PORT

    async def connect(self) -> Connection:
        conn = DeploymentConnection(self.address, self.timeout)
        await conn.queue()  # the channel is connected before the first arrival
        return conn

    async def disconnect(self, conn: Connection) -> None:
        assert isinstance(conn, DeploymentConnection)
        await conn.client.close()

    def counters(self) -> OpCounters:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10) as resp:
            return parse_counters(resp.read().decode())


def parse_counters(text: str) -> OpCounters:
    """``OpCounters`` from the scheduler's exposition: ``cdb_stage_compute_seconds`` (count and sum per stage),
    ``cdb_loop_batch_size`` (count and sum: decode loop ops and their tokens) and
    ``cdb_loop_decode_compute_seconds_total``."""
    ops: dict[str, int] = {st.role: 0 for st in Stage}
    compute: dict[str, float] = {st.role: 0.0 for st in Stage}
    loop_ops = loop_tokens = loop_decode = 0.0
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == "cdb_stage_compute_seconds_count":
                ops[sample.labels["stage"]] = int(sample.value)
            elif sample.name == "cdb_stage_compute_seconds_sum":
                compute[sample.labels["stage"]] = sample.value
            elif sample.name == "cdb_loop_batch_size_count":
                loop_ops = sample.value
            elif sample.name == "cdb_loop_batch_size_sum":
                loop_tokens = sample.value
            elif sample.name == "cdb_loop_decode_compute_seconds_total":
                loop_decode = sample.value
    return OpCounters(ops, compute, int(loop_ops), int(loop_tokens), loop_decode)


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
    env = with_public_caps(os.environ, max_live)
    metrics = free_address()
    with serve_all(cfg, "127.0.0.1:0", env=env, metrics_listen=metrics) as tree:
        yield DeploymentTarget(tree.address, timeout, metrics)
