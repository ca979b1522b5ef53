"""Refill policies: when a successor (a token whose prelude was issued) joins the loop, and when exited tokens may
go to the head. The three modes share the scheduler; they differ only here (and full depth in its exit policy).

- ``ContinuousRefill`` (``cdb``, ``full-depth``): a successor joins the very next loop op; exited tokens go to
  the head once ``min_head_batch_size`` of them wait (or whenever the loop has nothing else to run).
- ``WaveRefill`` (``no-refill``): early exit in lockstep waves. Successors wait for the next wave, which starts
  when the loop, the head and the preludes have drained; a wave's head op runs once, when its last token has left
  the loop.
"""

from __future__ import annotations

from collections import deque

from cdb_scheduler.config import Mode
from cdb_scheduler.request import Item
from cdb_scheduler.stats import SchedulerStats


class ContinuousRefill:
    held: tuple[Item, ...] = ()

    def place(self, it: Item, ready: deque[Item], stats: SchedulerStats) -> None:
        """``it``'s prelude was issued: queue it for the loop (a request's first decode token behind the others,
        a later one ahead of them, since its request is already resident)."""
        if ready:
            stats.refill_events += 1
        if it.index == 1:
            ready.append(it)
        else:
            ready.appendleft(it)

    def start_wave(self, ready: deque[Item], *, idle: bool) -> None:
        """Nothing is held back in continuous batching."""

    def reset(self) -> None:
        """Forget every held successor (the stages lost their state)."""

    def head_gate(self, *, waiting: bool, loop_drained: bool) -> bool | None:
        """None: issue no head op now; otherwise whether to flush (ignore ``min_head_batch_size``)."""
        return False


class WaveRefill:
    def __init__(self) -> None:
        self.held: list[Item] = []  # successors waiting for the next wave

    def place(self, it: Item, ready: deque[Item], stats: SchedulerStats) -> None:
        self.held.append(it)

    def start_wave(self, ready: deque[Item], *, idle: bool) -> None:
        if idle and self.held:
            ready.extend(it for it in self.held if it.live)
            self.held.clear()

    def reset(self) -> None:
        self.held.clear()

    def head_gate(self, *, waiting: bool, loop_drained: bool) -> bool | None:
        return True if waiting and loop_drained else None


def refill_policy(mode: Mode) -> ContinuousRefill | WaveRefill:
    return WaveRefill() if mode is Mode.NO_REFILL else ContinuousRefill()
