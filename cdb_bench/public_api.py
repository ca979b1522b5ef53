"""Sending a workload through the public API with the asyncio client (every request at once)."""

from __future__ import annotations

import asyncio
import time

from cdb_bench.workload import Workload
from cdb_engine.config import RequestParams
from clients.async_client import AsyncClient
from clients.messages import GenerateOptions


def options_of(p: RequestParams) -> GenerateOptions:
    s = p.sampling
    opts = GenerateOptions(
        max_tokens=p.max_tokens,
        ignore_eos=p.ignore_eos,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed,
    )
    if p.exit_threshold is not None:
        opts["exit_threshold"] = p.exit_threshold
    if p.replay_depths is not None:
        opts["replay_depths"] = p.replay_depths
    return opts


async def send_all(address: str, work: Workload) -> tuple[float, int]:
    async with AsyncClient(address, timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[client.generate(p, **options_of(q)) for p, q in zip(work.prompts, work.params)]
        )
        wall = time.perf_counter() - t0
    return wall, sum(len(r.tokens) for r in results)
