"""The loop stage's timeline over the steady window, from its per-op log (``CDB_STAGE_OP_LOG``): its busy
fraction, its idle gaps by cause, the reaction time, and, with the scheduler in this process, the reaction split by
hand-over (the executor's ``HopLog``)."""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

from cdb_bench.stats import order_statistic
from cdb_scheduler.plan import Stage
from services.telemetry.probe import HopLog


def reaction_split(ops: Sequence[Sequence[int]], hops: HopLog, window: tuple[int, int], depth: int) -> dict[str, Any]:
    """Where the reaction goes, from the end of loop op k to the sending of op k + ``depth`` (the op its reply lets
    the scheduler plan), hand-over by hand-over: the stage writes its reply (``stage_reply``), the engine thread
    reads it off the ring when it next polls (``ring``: mostly the engine busy with other work), takes its result
    (``to_engine``), plans and sends the op (``engine``: 0 when the op had gone before). p50 and mean, µs, over the
    window's loop replies (rings only); and the engine thread's CPU in sending a loop op (``send_cpu``: writing it
    to the ring and waking its stage, where it sleeps), over the window's loop ops."""
    t0, t1 = window
    ended = {r[0]: r[6] for r in ops}
    sent = {seq: ns for stage, seq, ns, _ in hops.sent if stage == Stage.LOOP}
    parts: dict[str, list[int]] = {"stage_reply": [], "ring": [], "to_engine": [], "engine": []}
    for stage, seq, written, read, polled in hops.replies:
        end, nxt = ended.get(seq), sent.get(seq + depth)
        if stage != Stage.LOOP or end is None or nxt is None or not t0 <= end <= t1:
            continue
        for key, ns in zip(parts, (written - end, read - written, polled - read, nxt - polled)):
            parts[key].append(max(0, ns))
    parts["send_cpu"] = [cpu for stage, seq, ns, cpu in hops.sent if stage == Stage.LOOP and t0 <= ns <= t1]
    return {
        key: {"p50": statistics.median(xs) / 1e3, "mean": statistics.fmean(xs) / 1e3} if xs else None
        for key, xs in parts.items()
    }


def loop_timeline(op_log: str, window: tuple[int, int], depth: int, hops: HopLog | None = None) -> dict[str, Any]:
    """The loop stage's busy fraction and its idle gaps by cause, over ``window`` (perf_counter ns); with ``hops``
    (the scheduler in this process) also the reaction's split (``reaction_split``)."""
    ops: list[list[int]] = []
    for path in glob.glob(os.path.join(op_log, "loop-*.json")):
        with open(path) as f:
            doc = json.load(f)
        ops.extend(doc["ops"])
    ops.sort(key=lambda r: r[6])  # by end: the loop stage runs its ops in order
    t0, t1 = window
    busy = 0.0
    late, fence, prep, idle = [], [], [], []
    reaction = []
    by_end = [r for r in ops if t0 <= r[6] <= t1]
    for i, r in enumerate(ops):
        _, _, arrived, dequeued, fenced, started, ended, compute = r
        lo, hi = max(started, t0), min(ended, t1)
        if hi > lo:
            busy += (hi - lo) * compute / max(1, ended - started)
        if i == 0 or not t0 <= started <= t1:
            continue
        prev_end = ops[i - 1][6]
        gap = max(0, started - prev_end)
        idle.append(gap)
        wait_arrival = min(gap, max(0, arrived - prev_end))
        late.append(wait_arrival)
        fence.append(min(gap - wait_arrival, max(0, fenced - max(dequeued, prev_end, arrived))))
        prep.append(max(0, gap - late[-1] - fence[-1]))
        if i + depth < len(ops):
            reaction.append(ops[i + depth][2] - ended)
    n = max(1, len(idle))
    computes = [r[7] for r in by_end]

    def q(xs: Sequence[int], p: float) -> float:
        return order_statistic(xs, p, math.floor) / 1e3 if xs else 0.0

    split = {"reaction_split_us": reaction_split(ops, hops, window, depth)} if hops is not None else {}
    return split | {
        "eta": busy / max(1, t1 - t0),
        "loop_ops": len(by_end),
        "mean_loop_op_us": statistics.fmean(computes) / 1e3 if computes else 0.0,
        "mean_loop_tokens": statistics.fmean(r[1] for r in by_end) if by_end else 0.0,
        "idle_us_per_op": {
            "total": sum(idle) / n / 1e3,
            "op_arrived_late": sum(late) / n / 1e3,
            "fences": sum(fence) / n / 1e3,
            "stage_preparation": sum(prep) / n / 1e3,
        },
        "reaction_us": {"p50": q(reaction, 0.5), "p90": q(reaction, 0.9)},
        "idle_max_us": max(idle, default=0) / 1e3,  # the loop stage's longest gap (a pause anywhere on its path)
    }
