"""The fence board: cross-process ordering of the stages' ops without a round trip through the scheduler.

One shared-memory segment holds, per stage, the ``seq`` of its last completed op (int64, initially -1) and a
32-bit wake word, plus an abort flag. A stage completes its ops in order, so "op ``seq`` of stage X is done"
is simply ``counter[X] >= seq``.

- ``complete(stage, seq)``: store the counter, bump the stage's wake word, ``FUTEX_WAKE`` its waiters.
- ``wait(fences, timeout)``: spin a few microseconds, then block in ``FUTEX_WAIT`` on the wake word of a stage
  still behind (Linux futexes work on shared memory across processes, and wake a sleeper in tens of
  microseconds without burning a core another stage needs). Each sleep is capped at 5 ms, so a missed wake
  (a weakly ordered CPU, a non-Linux host using the sleep fallback) costs at most that. Every stage writes only
  its own counter and wake word, so plain aligned stores suffice (single instructions on x86-64 and aarch64).

On CUDA a stage synchronizes its device work before ``complete``; interprocess CUDA events
(``cudaIpcGetEventHandle``) could later replace that host-side wait with a device-side one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping
from multiprocessing import shared_memory

from cdb_scheduler.plan import Fence, Stage
from services.transport import futex
from services.transport.segments import MappedSegment, attach_segment, create_segment

_N = len(Stage)
_ABORT = _N  # int64 index of the abort flag, after the counters
_WAKE_OFFSET = 8 * (_N + 1)  # byte offset of the int32 wake words
_SIZE = _WAKE_OFFSET + 8 * ((4 * _N + 7) // 8)  # a multiple of 8 bytes
_SLICE_S = 5e-3  # longest single sleep: bounds the cost of a missed wake


class FenceTimeout(TimeoutError):
    """A fence was not satisfied in time."""


class FenceAborted(RuntimeError):
    """The fence board was aborted (the scheduler saw a stage fail): waiting is pointless."""


class FenceBoard(MappedSegment):
    """Completion counters, wake words and an abort flag in shared memory. Use :meth:`create` / :meth:`attach`."""

    def __init__(self, segment: shared_memory.SharedMemory, owner: bool) -> None:
        buf = self._map(segment, owner)
        self._counters = buf[:_WAKE_OFFSET].cast("q")  # (_N + 1,) int64: counters, abort flag
        self._wake = buf[_WAKE_OFFSET : _WAKE_OFFSET + 4 * _N].cast("i")  # (_N,) int32
        self._wake_addr = [self._base + _WAKE_OFFSET + 4 * i for i in range(_N)]

    @classmethod
    def create(cls, completed: Mapping[Stage, int] | None = None) -> FenceBoard:
        """A new board; ``completed``: the counters to start from (default -1: nothing done). A board made after
        the stages lost their state starts at the last op issued before, so fences on those ops hold at once."""
        board = cls(create_segment("fence", _SIZE, "fence board"), owner=True)
        for stage in Stage:
            board._counters[stage] = (completed or {}).get(stage, -1)
            board._wake[stage] = 0
        board._counters[_ABORT] = 0
        return board

    @classmethod
    def attach(cls, name: str) -> FenceBoard:
        return cls(attach_segment(name), owner=False)

    def complete(self, stage: Stage, seq: int) -> None:
        """Publish that op ``seq`` of ``stage`` (and every earlier op of it) has completed; wake its waiters.

        Counters only move forward: a stale or replayed completion never un-completes a later op."""
        if seq > self._counters[stage]:
            self._counters[stage] = seq  # only the stage itself writes its counter: no lost update
        self._bump(stage)

    def _bump(self, stage: Stage) -> None:
        word = self._wake[stage]
        self._wake[stage] = word + 1 if word < 0x7FFFFFFF else 0
        futex.wake(self._wake_addr[stage])

    def completed(self, stage: Stage) -> int:
        """The last completed op of ``stage`` (-1: none)."""
        return int(self._counters[stage])

    def abort(self) -> None:
        """Make every current and future ``wait`` raise :class:`FenceAborted` (sleepers are woken). A board closed
        meanwhile by another thread (its session's close) has no waiter left: nothing to do."""
        with contextlib.suppress(ValueError):  # (its views were released under this call)
            self._counters[_ABORT] = 1
            for stage in Stage:
                self._bump(stage)

    @property
    def aborted(self) -> bool:
        return bool(self._counters[_ABORT])

    def ready(self, fences: Iterable[Fence]) -> bool:
        counters = self._counters
        return all(counters[f.stage] >= f.seq for f in fences)

    def wait(self, fences: tuple[Fence, ...], timeout: float, spin_s: float = 2e-5) -> float:
        """Block until every fence is satisfied; return the seconds waited.

        Raises :class:`FenceTimeout` after ``timeout`` seconds, :class:`FenceAborted` as soon as the board is
        aborted.
        """
        if not fences or self.ready(fences):
            return 0.0
        counters = self._counters
        start = time.perf_counter()
        deadline, spin_until = start + timeout, start + spin_s
        pause = 2e-5
        while True:
            if counters[_ABORT]:
                raise FenceAborted("fence board aborted")
            behind = next((f for f in fences if counters[f.stage] < f.seq), None)
            if behind is None:
                return time.perf_counter() - start
            now = time.perf_counter()
            if now >= deadline:
                missing = [f for f in fences if counters[f.stage] < f.seq]
                raise FenceTimeout(f"fences {missing} not satisfied after {timeout:.1f}s")
            if now < spin_until:
                continue
            if not futex.AVAILABLE:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
                continue
            word = self._wake[behind.stage]  # read the word BEFORE re-checking: a completion after this read
            if counters[behind.stage] < behind.seq and not counters[_ABORT]:  # changes it, so the wait returns
                futex.wait(self._wake_addr[behind.stage], word, min(_SLICE_S, deadline - now))

    def close(self) -> None:
        """Unmap; the owner also unlinks. Idempotent."""
        self._unmap(self._counters, self._wake)
