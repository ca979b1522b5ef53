"""The routing study on real replicas: K local process trees, the policies through the real clients, open loop.

- ``round-robin`` is gRPC's own: one ``clients.async_client.AsyncClient`` over the K addresses, whose service
  config carries ``round_robin`` and the retry policy (``clients.balancing``);
- every other policy is a client-side picker (``cdb_bench.routing.policies``) over K clients, one per replica,
  counting its own outstanding requests per replica.

Each replica is ``services.launcher.serve_all`` on a fixed loopback port with ``--allow-replay-depths``; a request
replays its depths (a deep one, its max depth at every token: the server refuses a threshold beside replayed
depths, so the threshold stays on the client, where the picker reads it). Runs go policy after policy at each
rate, ``repeats`` times interleaved, so a slow spell of a shared machine hits every policy alike. Figures are
``cdb_bench.serve.metrics.summarize_run``'s (times from each request's scheduled arrival).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cdb_bench.processes import free_address, trees, with_public_caps
from cdb_bench.routing.policies import Policy
from cdb_bench.routing.workload import RoutedRequest
from cdb_bench.serve.driver import drive
from cdb_bench.serve.metrics import Slo, summarize_run
from cdb_bench.serve.requests import ServeRequest
from cdb_engine.config import EngineConfig
from clients.async_client import AsyncClient
from clients.messages import GenerateOptions, StreamToken

SLO = Slo(ttft_s=1.0, tpot_s=0.1)  # recorded by summarize_run; the study reads latencies only


@contextmanager
def local_replicas(cfg: EngineConfig, replicas: int, max_live: int) -> Iterator[list[str]]:
    """Start ``replicas`` trees of ``cfg`` at once on fixed loopback ports; yield their addresses; stop them."""
    env = with_public_caps(dict(os.environ, CDB_HTTP_ADDR="", CDB_METRICS_ADDR=""), max_live)  # no shared ports
    with trees(cfg, [free_address() for _ in range(replicas)], env, drain_timeout=2.0) as started:
        yield [t.address for t in started]


def _options(req: ServeRequest) -> GenerateOptions:
    assert req.replay_depths is not None
    return GenerateOptions(max_tokens=req.max_tokens, ignore_eos=True, replay_depths=req.replay_depths)


async def _depths(client: AsyncClient, req: ServeRequest) -> AsyncIterator[int]:
    async for item in client.stream(req.prompt_arg(), **_options(req)):
        if isinstance(item, StreamToken):
            yield item.depth
        elif item.finish_reason not in ("length", "stop"):
            raise RuntimeError(f"finished with {item.finish_reason}: {item.error}")


class _Connection:
    """What ``cdb_bench.serve.driver.drive`` drives: one request at a time through ``stream``; queue counters
    summed over direct clients of every replica."""

    def __init__(self, addresses: Sequence[str], requests: Sequence[RoutedRequest], timeout: float) -> None:
        self.direct = [AsyncClient(a, timeout=timeout) for a in addresses]
        self.views = {r.serve.index: r.view for r in requests}
        self.timeout = timeout

    async def queue(self) -> tuple[int, int]:
        infos = await asyncio.gather(*(c.info() for c in self.direct))
        return sum(i.counters["waiting"] for i in infos), sum(i.counters["running"] for i in infos)

    async def close(self) -> None:
        for c in self.direct:
            await c.close()


class GrpcRoundRobin(_Connection):
    """gRPC's ``round_robin`` over every address, with the retry policy: one channel."""

    def __init__(self, addresses: Sequence[str], requests: Sequence[RoutedRequest], timeout: float) -> None:
        super().__init__(addresses, requests, timeout)
        self.balanced = AsyncClient(list(addresses), timeout=timeout)

    def stream(self, req: ServeRequest) -> AsyncIterator[int]:
        return _depths(self.balanced, req)

    async def close(self) -> None:
        await self.balanced.close()
        await super().close()


class Picker(_Connection):
    """A client-side picker: ``policy`` chooses a replica from this client's outstanding counts."""

    def __init__(
        self, addresses: Sequence[str], requests: Sequence[RoutedRequest], timeout: float, policy: Policy
    ) -> None:
        super().__init__(addresses, requests, timeout)
        self.policy = policy
        self.outstanding = [0] * len(addresses)
        self.picked = [0] * len(addresses)

    async def stream(self, req: ServeRequest) -> AsyncIterator[int]:
        k = self.policy.pick(self.views[req.index], self.outstanding)
        self.outstanding[k] += 1
        self.picked[k] += 1
        try:
            async for depth in _depths(self.direct[k], req):
                yield depth
        finally:
            self.outstanding[k] -= 1


async def _run(conn: GrpcRoundRobin | Picker, requests: Sequence[ServeRequest]) -> dict[str, Any]:
    try:
        await conn.queue()  # every channel connected before the first arrival
        records, samples = await drive(conn, requests)
    finally:
        await conn.close()
    summary = summarize_run(records, 0.0, SLO)
    waiting = [w for _, w, _ in samples]
    summary["max_waiting"] = max(waiting, default=None)
    if isinstance(conn, Picker):
        summary["per_replica_requests"] = conn.picked
    return summary


def run_policy(
    addresses: Sequence[str],
    name: str,
    policy: Policy | None,
    requests: Sequence[RoutedRequest],
    *,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """One open-loop run of ``requests`` (arrivals already at the rate) through ``name``'s client; ``policy``
    None: gRPC's round_robin. Returns ``summarize_run``'s figures (+ ``max_waiting``, the picker's counts)."""

    async def main() -> dict[str, Any]:
        conn: GrpcRoundRobin | Picker
        if policy is None:
            conn = GrpcRoundRobin(addresses, requests, timeout)
        else:
            conn = Picker(addresses, requests, timeout, policy)
        return await _run(conn, [r.serve for r in requests])

    result = asyncio.run(main())
    result["policy"] = name
    return result


def warm_up(addresses: Sequence[str], requests: Sequence[RoutedRequest]) -> None:
    """A few short requests on every replica (first-call costs out of the measured runs)."""

    async def main() -> None:
        clients = [AsyncClient(a, timeout=120) for a in addresses]
        try:
            short = [r.serve for r in requests[:2]]
            calls = [c.generate(q.prompt_arg(), max_tokens=2, ignore_eos=True) for c in clients for q in short]
            await asyncio.gather(*calls)
        finally:
            for c in clients:
                await c.close()

    asyncio.run(main())
