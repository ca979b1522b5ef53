"""The soak's figures: requests lost or different from a fault-free reference, recovery times per fault kind, the
latency the faults added, and the report."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any

from cdb_bench.soak.faults import KINDS, Fault
from cdb_bench.soak.requests import SERVED_DTYPE, Outcome, Planned
from cdb_bench.stats import order_statistic
from cdb_engine.config import DType

Tokens = list[tuple[int, int]]  # (id, depth) of each token of a request


def _percentile(values: Sequence[float], q: float) -> float | None:
    return order_statistic(values, q) if values else None


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": _percentile(values, 0.5), "p99": _percentile(values, 0.99), "max": max(values) if values else None}


def judge(
    planned: list[Planned], outs: list[Outcome], want: list[list[tuple[int, int]]]
) -> tuple[list[dict[str, Any]], list[int]]:
    """(lost, mismatched): requests that ended other than as drawn, and indexes of those whose tokens differ
    from ``want``."""
    lost: list[dict[str, Any]] = []
    mismatched: list[int] = []
    for p, o, w in zip(planned, outs, want):
        ok_status = o.status == p.fate or (p.fate == "cancel" and o.status == "complete" and len(o.tokens) == len(w))
        if p.fate == "deadline" and o.status == "complete":
            ok_status = True  # it beat its deadline
        if not ok_status:
            lost.append({"index": p.index, "fate": p.fate, "status": o.status, "tokens": len(o.tokens)})
        expected = w if o.status == "complete" else w[: len(o.tokens)]
        if o.tokens != expected:
            mismatched.append(p.index)
    return lost, mismatched


def _against(
    planned: list[Planned], outs: list[Outcome], refs: dict[str, list[Tokens]], touched: set[int]
) -> dict[str, Any]:
    """Per reference dtype: the requests whose tokens differ from it, split into those in flight at a fault and
    those no fault touched."""
    against: dict[str, Any] = {}
    for dtype, want in refs.items():
        _, differ = judge(planned, outs, want)
        against[dtype] = {
            "mismatched": len(differ),
            "mismatched_in_flight_at_a_fault": sum(i in touched for i in differ),
            "mismatched_untouched": sum(i not in touched for i in differ),
            "examples": differ[:10],
        }
    return against


def _longest_gaps(planned: list[Planned], outs: list[Outcome]) -> tuple[dict[int, float], dict[int, float]]:
    """Per request with a token: its longest gap between tokens (or to the first one), and when that gap ended."""
    gaps: dict[int, float] = {}
    gap_at: dict[int, float] = {}
    for p, o in zip(planned, outs):
        if o.times:
            stamps = [o.start, *o.times]
            gaps[p.index], gap_at[p.index] = max((b - a, b) for a, b in itertools.pairwise(stamps))
    return gaps, gap_at


def _slowest(
    planned: list[Planned], outs: list[Outcome], gaps: dict[int, float], gap_at: dict[int, float], t0: float
) -> list[dict[str, Any]]:
    """The five requests with the longest gaps, times from the start of the traffic."""
    return [
        {
            "index": i,
            "fate": planned[i].fate,
            "status": outs[i].status,
            "tokens": len(outs[i].tokens),
            "start_s": outs[i].start - t0,
            "end_s": outs[i].end - t0,
            "longest_gap_s": gaps[i],
            "gap_ended_s": gap_at[i] - t0,
        }
        for i in sorted(gaps, key=gaps.__getitem__, reverse=True)[:5]
    ]


def _by_kind(faults: list[Fault]) -> dict[str, Any]:
    """Per fault kind: count, recovery and re-attach times, the late ones, the targets; for freezes also the
    detection time and the frozen processes nobody killed."""
    by_kind: dict[str, Any] = {}
    for kind in KINDS:
        mine = [f for f in faults if f.kind == kind]
        times = [f.recovery_s for f in mine if f.recovery_s is not None]
        entry: dict[str, Any] = {
            "count": len(mine),
            "recovery_s": _spread(times),
            "reattach_s": _spread([f.reattach_s for f in mine if f.reattach_s is not None]),
            "unrecovered": len(mine) - len(times),
            "late": sum(f.waited_s > 0 for f in mine),  # every replica was still recovering at its tick
            "waited_s": sum(f.waited_s for f in mine),
            "by_target": {t: sum(f.target == t for f in mine) for t in sorted({f.target for f in mine})},
        }
        if kind == "stage_freeze":
            entry["detection_s"] = _spread([f.detected_s for f in mine if f.detected_s is not None])
            entry["not_killed"] = sum(f.killed is False for f in mine)
        by_kind[kind] = entry
    return by_kind


def _fault_log(faults: list[Fault], t0: float) -> list[dict[str, Any]]:
    return [
        {
            "kind": f.kind,
            "replica": f.replica,
            "target": f.target,
            "at_s": f.at - t0,
            "waited_s": f.waited_s,
            "detected_s": f.detected_s,
            "recovery_s": f.recovery_s,
            "reattach_s": f.reattach_s,
            **({"killed": f.killed} if f.kind == "stage_freeze" else {}),
        }
        for f in faults
    ]


def summarize(
    planned: list[Planned],
    outs: list[Outcome],
    refs: dict[str, list[Tokens]],
    tree_dtype: str,
    faults: list[Fault],
    t0: float,
) -> dict[str, Any]:
    """The run's figures (see ``cdb_bench.soak.cli``); ``refs``: the fault-free tokens per reference dtype."""
    fault_times = [f.at for f in faults]
    touched = {p.index for p, o in zip(planned, outs) if any(o.start <= t <= (o.end or t) for t in fault_times)}
    lost, mismatched = judge(planned, outs, refs[tree_dtype])
    against = _against(planned, outs, refs, touched)
    gaps, gap_at = _longest_gaps(planned, outs)
    calm = [g for i, g in gaps.items() if i not in touched]
    base = statistics.median(calm) if calm else 0.0
    added = [max(0.0, gaps[i] - base) for i in touched if i in gaps]
    return {
        "requests": len(planned),
        "fates": {f: sum(p.fate == f for p in planned) for f in ("complete", "cancel", "deadline")},
        "statuses": {s: sum(o.status == s for o in outs) for s in sorted({o.status for o in outs})},
        "faults": _by_kind(faults),
        "fault_log": _fault_log(faults, t0),
        "unrecovered_faults": sum(f.recovery_s is None for f in faults) + sum(f.killed is False for f in faults),
        "lost": len(lost),
        "lost_examples": lost[:10],
        "tree_dtype": tree_dtype,
        "mismatched": len(mismatched),
        "mismatched_examples": mismatched[:10],
        "mismatched_float64_reference": against[DType.FLOAT64.value]["mismatched"],
        "mismatched_served_dtype_reference": against[SERVED_DTYPE.value]["mismatched"],
        "against_reference": against,
        "references_differ": sum(a != b for a, b in zip(refs[DType.FLOAT64.value], refs[SERVED_DTYPE.value])),
        "recovered_requests": len(touched),
        "added_latency_s": {"p50": _percentile(added, 0.5), "p99": _percentile(added, 0.99), "baseline_gap_s": base},
        "slowest_requests": _slowest(planned, outs, gaps, gap_at, t0),
    }


def served_dtype_verdict(summary: dict[str, Any]) -> tuple[bool | None, str]:
    """Whether recomputation was exact in the served dtype, and the line that says so."""
    served = summary["against_reference"][SERVED_DTYPE.value]
    n, differ = summary["recovered_requests"], served["mismatched_in_flight_at_a_fault"]
    refs = f"the float32 and float64 fault-free runs differ on {summary['references_differ']} requests"
    if summary["tree_dtype"] != SERVED_DTYPE.value:
        return None, (
            f"recomputation in {SERVED_DTYPE} (served dtype): not tested, the tree ran {summary['tree_dtype']} "
            f"(--dtype {SERVED_DTYPE} tests it); {refs}"
        )
    if served["mismatched_untouched"]:
        return False, (
            f"recomputation in {SERVED_DTYPE} (served dtype): cannot be exact, {served['mismatched_untouched']} "
            f"requests no fault touched already differ from the {SERVED_DTYPE} fault-free run (batching changes "
            f"tokens); {differ} of {n} recovered requests differ; {refs}"
        )
    exact = differ == 0
    return exact, (
        f"recomputation in {SERVED_DTYPE} (served dtype): {'exact' if exact else 'NOT exact'}, {differ} of {n} "
        f"requests in flight at a fault differ from the {SERVED_DTYPE} fault-free run; {refs}"
    )


def report(summary: dict[str, Any]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"requests {summary['requests']} {summary['fates']} over {summary['config']['replicas']} replicas "
        f"in {summary['wall_s']:.0f}s, tree dtype {summary['tree_dtype']}",
        f"lost {summary['lost']}  mismatched {summary['mismatched']} (float64 reference "
        f"{summary['mismatched_float64_reference']}, {SERVED_DTYPE} reference "
        f"{summary['mismatched_served_dtype_reference']})  leaked {summary['leaked']}  "
        f"unrecovered faults {summary['unrecovered_faults']}",
    ]
    for kind, f in summary["faults"].items():
        rec = f["recovery_s"]
        line = f"{kind}: {f['count']} {f['by_target']}  recovery s p50 {fmt(rec['p50'])} p99 {fmt(rec['p99'])}"
        line += f" max {fmt(rec['max'])}"
        if f["reattach_s"]["p50"] is not None:
            line += f"  re-attached s p50 {fmt(f['reattach_s']['p50'])} p99 {fmt(f['reattach_s']['p99'])}"
        if f["late"]:
            line += f"  late {f['late']} (waited {f['waited_s']:.0f}s for a replica back in service)"
        if "detection_s" in f:
            line += f"  detected s p50 {fmt(f['detection_s']['p50'])}"
        lines.append(line)
    add = summary["added_latency_s"]
    lines.append(
        f"added latency of {summary['recovered_requests']} requests in flight at a fault s: "
        f"p50 {fmt(add['p50'])} p99 {fmt(add['p99'])}"
    )
    lines.append(summary["served_dtype_verdict"])
    return "\n".join(lines)
