"""The open-loop client: every request starts at its scheduled arrival, whether or not earlier ones finished.

All starts are put on the event loop's timer heap up front (``loop.call_at``), so the client does no work between
arrivals but hand each request to its connection; a sampler reads the server's queue counters every
``sample_interval`` seconds. The client's lag (send time - scheduled time) is recorded per request.

``max_concurrency`` caps the requests in flight: arrivals stay scheduled, and a request that arrives while the cap
is reached waits on the client (first come, first served) until one finishes; the wait shows as client lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from cdb_bench.serve.metrics import RequestRecord, Usage
from cdb_bench.serve.requests import ServeRequest

StreamItem = int | None | Usage  # a token: its served depth (None: not reported); or the request's usage

LEAD_S = 0.05  # the run starts this long after the schedule is laid, so the first arrival is not already late


class Connection(Protocol):
    """One client's link to a target (``cdb_bench.serve.targets``)."""

    def stream(self, req: ServeRequest) -> AsyncIterator[StreamItem]:
        """Send ``req`` when first iterated; yield each token's served depth as it arrives (None where the server
        does not report it; a server that streams chunks of text: one item per chunk), and the server's ``Usage``
        if it reports one; end after the finish; raise if the request failed."""
        ...

    async def queue(self) -> tuple[int, int]:
        """The server's (waiting, running) counters now."""
        ...


async def _one(
    conn: Connection,
    req: ServeRequest,
    rec: RequestRecord,
    clock: Callable[[], float],
    slots: asyncio.Semaphore | None,
) -> None:
    async with slots if slots is not None else contextlib.nullcontext():
        tokens = conn.stream(req)
        rec.sent_s = clock()  # the generator sends on its first step, right below
        try:
            async for item in tokens:
                now = clock()
                if isinstance(item, Usage):
                    rec.add_usage(item)
                    continue
                rec.token_s.append(now)
                if item is not None:
                    rec.depths.append(item)
            rec.finished_s = clock()
        except Exception as exc:  # a failed request is counted as failed; the run goes on
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            rec.ended_s = clock()  # before the slot is released: the next request is sent after this


async def _sample(
    conn: Connection, clock: Callable[[], float], interval: float, out: list[tuple[float, int, int]]
) -> None:
    """(t, waiting, running) on the grid t = 0, interval, 2 interval, ... (a slow read skips grid points)."""
    slot = 0
    while True:
        await asyncio.sleep(max(0.0, slot * interval - clock()))
        t = clock()
        try:
            waiting, running = await conn.queue()
            out.append((t, waiting, running))
        except Exception:  # a counter read that fails only leaves a gap in the series
            pass
        slot = max(slot + 1, math.floor(clock() / interval) + 1)


async def drive(
    conn: Connection,
    requests: Sequence[ServeRequest],
    *,
    sample_interval: float | None = 0.1,
    on_done: Callable[[], None] | None = None,
    max_concurrency: int | None = None,
) -> tuple[list[RequestRecord], list[tuple[float, int, int]]]:
    """Run ``requests`` open-loop on ``conn`` (at most ``max_concurrency`` in flight; None: no cap); returns their
    records and the (t, waiting, running) samples (none when ``sample_interval`` is None)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    loop = asyncio.get_running_loop()
    t0 = loop.time() + LEAD_S

    def clock() -> float:
        return loop.time() - t0

    records = [RequestRecord(r.index, r.arrival_s, r.prompt_len) for r in requests]
    tasks: list[asyncio.Task[None]] = []
    started = loop.create_future()
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None

    def start(req: ServeRequest, rec: RequestRecord) -> None:
        task = loop.create_task(_one(conn, req, rec, clock, slots))
        if on_done is not None:
            task.add_done_callback(lambda _: on_done())
        tasks.append(task)
        if len(tasks) == len(requests):
            started.set_result(None)

    for req, rec in zip(requests, records):
        loop.call_at(t0 + req.arrival_s, start, req, rec)
    samples: list[tuple[float, int, int]] = []
    sampler = loop.create_task(_sample(conn, clock, sample_interval, samples)) if sample_interval else None
    try:
        if requests:
            await started
        await asyncio.gather(*tasks)
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
    return records, samples
