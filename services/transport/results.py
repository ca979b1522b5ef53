"""Where stage results wait for the engine thread (the executor's one poller).

Any thread may post to the queue (a released result, an error result, a ``StageLoss``, a wake). With rings, the
poller reads the replies rings itself between sleeps on one doorbell (``ring.Doorbell``) that every stage rings
after a reply and that every post rings too; a result its own read releases takes the *straight lane*: handed
back by that same ``next`` call, without passing through the queue.

Order: results are released under the executor's lock, in causal order (``ordering.CausalOrder``); each goes to
the straight lane only while the queue is empty or the lane already holds results, and ``next`` empties the lane
first, so every result in the lane was released before every result in the queue.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Iterable

from cdb_scheduler.plan import StageResult
from services.transport.ring import Doorbell


class ResultQueue:
    """The results of one executor on their way to its poller (module docstring)."""

    def __init__(self, doorbell: Doorbell | None) -> None:
        self.doorbell = doorbell  # rings only: the poller sleeps on it and reads the replies itself
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lane: deque[StageResult] = deque()  # released by the poller's own read of the rings

    def post(self, item: object) -> None:
        """Queue ``item`` for the poller and wake it where it sleeps on the doorbell (from any thread)."""
        self._queue.put(item)
        if self.doorbell is not None:
            self.doorbell.ring()

    def release(self, results: Iterable[StageResult], poller: bool) -> None:
        """Hand over released ``results``, in order (callers serialize releases: the executor's lock). ``poller``:
        released by the poller's own read of the rings (it looks again before it sleeps: no ring needed)."""
        if poller and (self._lane or self._queue.empty()):
            self._lane.extend(results)
        elif poller or self.doorbell is None:
            for result in results:
                self._queue.put(result)
        else:
            for result in results:
                self.post(result)

    def next(self, timeout: float | None, read: Callable[[], int]) -> object:
        """The next item within ``timeout`` (None: none came). With the doorbell, ``read`` reads the replies
        rings (releasing what it can) and says how many replies it read."""
        bell = self.doorbell
        if bell is None:
            try:
                return self._queue.get(timeout=timeout)
            except queue.Empty:
                return None
        lane = self._lane
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            if lane:
                return lane.popleft()
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            word = bell.word()  # before looking: a reply written after this read changes it
            if read():
                continue
            left = 1.0 if deadline is None else deadline - time.perf_counter()
            if left <= 0:
                return None
            if self._queue.empty():
                bell.wait(word, left)

    def close(self) -> None:
        """Free the doorbell; a poller asleep on it looks once more and finds nothing."""
        if self.doorbell is not None:
            self.doorbell.ring()
            self.doorbell.close()
