"""The garbage collector of a serving process, settled once the process has started.

A process's startup allocates most of its heap for good: imported modules (torch alone: hundreds of thousands of
objects), the model, the servers. CPython's cyclic collector scans the whole tracked heap at each full collection
(generation 2), which a serving loop that keeps objects for a few steps (a token's item, a request) triggers every
so often: each one a pause of the thread that triggered it, landing on the loop step being planned or launched.
``settle`` collects what startup left behind once, then freezes the rest (``gc.freeze``: a permanent generation
that no collection scans again). The young generations are collected as before, so cyclic garbage made while
serving is still freed; only objects allocated before ``settle`` are never collected, and they are not garbage.

``cdb bench heap`` measures a full collection in a stage's and in the scheduler's process, unsettled and settled
(``docs/benchmarks.md``).
"""

from __future__ import annotations

import gc
import time


def settle() -> int:
    """Collect once, then freeze every object now tracked so that no later collection scans it. Call once the
    process has loaded and started what it serves (calling again freezes what was allocated since). Returns the
    number of objects frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def full_collection_ms(repeat: int = 3) -> float:
    """The shortest of ``repeat`` full collections (ms): the pause one costs the thread that triggers it."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - start)
    return best * 1e3
