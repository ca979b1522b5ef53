"""``cdb bench heap``: the pause of a full garbage collection in a stage's and in the scheduler's process, with the
startup heap unsettled and settled (``services.heap.settle``, which every serving process calls once started)."""

from __future__ import annotations

import argparse
import gc
import json
from typing import Any

from services import heap


def measure(process: str, model: str) -> dict[str, Any]:
    """Load what ``process`` loads (a stage: its modules and ``model``; the scheduler: its modules), then time a full
    collection before and after settling this process's heap. Settles the calling process."""
    loaded = []  # kept until measured
    if process == "stage":
        from cdb_model.loader import load_model
        from services.transport import stage_server  # noqa: F401 (what a stage process imports)

        loaded.append(load_model(model))
    else:
        from services.api import server  # noqa: F401 (what the scheduler's process imports)
    unsettled = heap.full_collection_ms()
    tracked = len(gc.get_objects())
    frozen = heap.settle()
    return {
        "process": process,
        "model": model if loaded else None,
        "tracked_objects": tracked,
        "frozen_objects": frozen,
        "full_collection_ms": {"unsettled": unsettled, "settled": heap.full_collection_ms()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cdb bench heap", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("process", choices=["stage", "scheduler"], help="whose modules (and model) to load first")
    p.add_argument("--model", default="ouro-tiny", help="the stage process's model")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = measure(args.process, args.model)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        ms = out["full_collection_ms"]
        print(
            f"{args.process}: {out['tracked_objects']} tracked objects; a full collection "
            f"{ms['unsettled']:.3f} ms unsettled, {ms['settled']:.4f} ms settled"
        )
    return 0
