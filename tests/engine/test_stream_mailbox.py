"""The engine thread's hand-over to an event loop: one wake-up per burst of events, order kept per stream."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cdb_engine.events import Event
from cdb_engine.stream import LoopMailbox, RequestStream


def _token(i: int) -> Event:
    return i  # type: ignore[return-value]  # the mailbox carries events opaquely


def test_a_burst_from_another_thread_reaches_every_stream_in_order_with_one_wake_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    drains = 0
    drain = LoopMailbox._drain

    def counted(self: LoopMailbox) -> None:
        nonlocal drains
        drains += 1
        drain(self)

    monkeypatch.setattr(LoopMailbox, "_drain", counted)

    async def main() -> list[list[int]]:
        streams = [RequestStream(lambda: None, None) for _ in range(3)]
        # The engine thread posts one stage result's events while the loop is busy (blocked here): the whole
        # burst must be delivered by a single drain.
        poster = threading.Thread(target=lambda: [s.sink(_token(i)) for i in range(50) for s in streams])
        poster.start()
        poster.join()
        await asyncio.sleep(0)  # one loop iteration: the scheduled drain runs
        return [[s._queue.get_nowait() for _ in range(s._queue.qsize())] for s in streams]  # type: ignore[misc]

    got = asyncio.run(main())
    assert got == [list(range(50))] * 3
    assert drains == 1


def test_every_event_arrives_when_posting_races_the_drains() -> None:
    async def main() -> list[int]:
        stream = RequestStream(lambda: None, None)
        poster = threading.Thread(target=lambda: [stream.sink(_token(i)) for i in range(20_000)])
        poster.start()
        got: list[int] = []
        while len(got) < 20_000:
            got.append(await stream._queue.get())  # type: ignore[arg-type]
        poster.join()
        return got

    assert asyncio.run(main()) == list(range(20_000))


def test_posting_to_a_closed_loop_raises_so_the_engine_ends_the_request() -> None:
    async def opened() -> RequestStream:
        return RequestStream(lambda: None, None)

    loop = asyncio.new_event_loop()
    stream = loop.run_until_complete(opened())
    loop.close()
    with pytest.raises(RuntimeError):
        stream.sink(_token(1))
    with pytest.raises(RuntimeError):  # and again: nothing was left pending that would swallow the next one
        stream.sink(_token(2))
