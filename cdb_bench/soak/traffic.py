"""The soak's traffic: one ``AsyncClient`` over every replica's address streams the planned requests, each
behaving as drawn (read to the end, cancel after a few tokens, or carry a short deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncGenerator, Callable
from typing import cast

import grpc
from tqdm import tqdm

from cdb_bench.soak.replicas import CHANNEL_OPTIONS
from cdb_bench.soak.requests import Outcome, Planned
from clients.async_client import AsyncClient
from clients.messages import StreamFinish, StreamToken


async def _one(
    client: AsyncClient,
    p: Planned,
    out: Outcome,
    gate: asyncio.Semaphore,
    bar: tqdm,
    resume_attempts: int,
    started: Callable[[], None],
) -> None:
    async with gate:
        out.start = time.monotonic()
        started()
        timeout = p.deadline_s if p.fate == "deadline" else 600.0
        stream = cast(
            AsyncGenerator[StreamToken | StreamFinish, None],  # an async generator: it has aclose
            client.stream(p.prompt, timeout=timeout, resume_attempts=resume_attempts, **p.options()),
        )
        try:
            async with contextlib.aclosing(stream) as items:  # leaving early cancels the call at once
                async for item in items:
                    if isinstance(item, StreamToken):
                        out.tokens.append((item.id, item.depth))
                        out.times.append(time.monotonic())
                        if p.fate == "cancel" and len(out.tokens) >= p.cancel_after:
                            out.status = "cancel"
                            break
            out.status = out.status or "complete"
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            out.status = "deadline" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name
        except Exception as exc:  # counted as lost, never a crashed soak
            out.status = type(exc).__name__
        out.end = time.monotonic()
        bar.update(1)


async def drive(
    addresses: list[str],
    planned: list[Planned],
    concurrency: int,
    resume_attempts: int,
    started: Callable[[], None] = lambda: None,
) -> list[Outcome]:
    """Stream every planned request, ``concurrency`` at a time; ``started`` is called as each one starts."""
    outs = [Outcome() for _ in planned]
    client = AsyncClient(addresses, timeout=600, options=CHANNEL_OPTIONS)
    gate = asyncio.Semaphore(concurrency)
    with tqdm(total=len(planned), desc="soak", unit="req", file=sys.stderr) as bar:
        await asyncio.gather(*(_one(client, p, o, gate, bar, resume_attempts, started) for p, o in zip(planned, outs)))
    await client.close()
    return outs
