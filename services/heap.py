"""The garbage collector of a serving process, settled once the process has started.

A process's startup allocates most of its heap for good: imported modules (torch alone: hundreds of thousands of
objects), the model, the servers. CPython's cyclic collector scans the whole tracked heap at each full collection
(generation 2), which a serving loop that keeps objects for a few steps (a token's item, a request) triggers every
so often: each one a pause of the thread that triggered it, landing on the loop step being planned or launched.
``settle`` collects what startup left behind once, then freezes the rest (``gc.freeze``: a permanent generation
that no collection scans again). The young generations are collected as before, so cyclic garbage made while
serving is still freed; only objects allocated before ``settle`` are never collected, and they are not garbage.

``python -m services.heap`` measures a full collection in a stage's and in the scheduler's process, unsettled and
settled (JSON; ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import gc
import json
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.heap", description="a full collection, unsettled and settled")
    p.add_argument("process", choices=["stage", "scheduler"], help="whose modules (and model) to load first")
    p.add_argument("--model", default="ouro-tiny", help="the stage process's model")
    args = p.parse_args(argv)
    if args.process == "stage":
        from cdb_model.loader import load_model
        from services.transport import stage_server  # noqa: F401 (what a stage process imports)

        loaded = [load_model(args.model)]  # kept until measured
    else:
        loaded = []
        from services.scheduler import server  # noqa: F401 (what the scheduler's process imports)
    unsettled = full_collection_ms()
    tracked = len(gc.get_objects())
    frozen = settle()
    out = {"process": args.process, "tracked_objects": tracked, "frozen_objects": frozen}
    out |= {"full_collection_ms": {"unsettled": unsettled, "settled": full_collection_ms()}}
    out["model"] = args.model if loaded else None
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
