"""``cdb bench hostpath``'s outputs: the table of every run, each point's median and range over rounds, and
``hostpath.json`` with ``eta.png``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cdb_bench import outputs
from cdb_bench.stats import median_range

_IDENTITY = ("family", "cost", "op_us", "width", "consumer", "fuse_loop_head", "transport", "frontends")
_FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "eta": lambda r: r["eta"],
    "tokens_per_s": lambda r: r["tokens_per_s"],
    "of_ideal": lambda r: r["of_ideal"],
    "sched_cpu_us_per_step": lambda r: r["sched_cpu_us_per_step"]["process"],
    "loop_stage_cpu_us_per_op": lambda r: r["loop_stage_cpu_us_per_op"],
    "idle_op_arrived_late_us": lambda r: r["idle_us_per_op"]["op_arrived_late"],
    "idle_fences_us": lambda r: r["idle_us_per_op"]["fences"],
    "idle_stage_preparation_us": lambda r: r["idle_us_per_op"]["stage_preparation"],
    "reaction_p50_us": lambda r: r["reaction_us"]["p50"],
    "host_busy": lambda r: r["host"]["busy"],
    "host_steal": lambda r: r["host"]["steal"],
    "host_cpu_us_per_op": lambda r: r["host"]["cpu_us_per_op"],
    "eta_cpu_bound": lambda r: r["host"]["eta_bound"],
}


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point (its identity: family, cost, width, consumer, ...): how many runs, and each figure's median, lowest
    and highest over them (this machine's noise is in the range; a median moves little for one bad run)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in _IDENTITY), []).append(r)
    out = []
    for key, runs in groups.items():
        entry: dict[str, Any] = dict(zip(_IDENTITY, key)) | {"runs": len(runs)}
        for name, figure in _FIGURES.items():
            entry[name] = median_range(figure(r) for r in runs)
        out.append(entry)
    return out


def median_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"medians over rounds: {'family':<7}{'cost':<18}{'w':>4} {'consumer':<11}{'runs':>5}{'eta':>7} {'(range)':<13}"
        f"{'tok/s':>9}{'cpu us/step':>12}{'late':>7}{'fence':>7}{'prep':>6}{'react':>7}"
        f"{'host busy':>10}{'steal':>6}{'bound':>6}"
    ]
    for r in rows:
        cost = f"{r['op_us']:g}us flat" if r["op_us"] is not None else r["cost"]
        e = r["eta"]
        spread = f"({e['min']:.2f}-{e['max']:.2f})"
        lines.append(
            f"{'':<21}{r['family']:<7}{cost:<18}{r['width']:>4} {_consumer(r):<11}{r['runs']:>5}{e['median']:>7.3f} "
            f"{spread:<13}{r['tokens_per_s']['median']:>9.0f}"
            f"{r['sched_cpu_us_per_step']['median']:>12.0f}{r['idle_op_arrived_late_us']['median']:>7.0f}"
            f"{r['idle_fences_us']['median']:>7.0f}{r['idle_stage_preparation_us']['median']:>6.0f}"
            f"{r['reaction_p50_us']['median']:>7.0f}{r['host_busy']['median']:>10.2f}"
            f"{r['host_steal']['median']:>6.2f}{r['eta_cpu_bound']['median']:>6.2f}"
        )
    return "\n".join(lines)


def _consumer(r: dict[str, Any]) -> str:
    return f"{r['consumer']} fe{r['frontends']}" if r.get("frontends") else str(r["consumer"])


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'family':<7}{'cost':<18}{'w':>4} {'consumer':<11}{'fused':<6}{'data':<8}{'eta':>6}{'of ideal':>9}"
        f"{'tok/s':>9}{'depth':>6}"
        f"{'op us':>8}{'late':>7}{'fence':>7}{'prep':>6}{'react':>7}  cpu us/step: plan submit dispatch rest other"
        "  loop stage  host: busy steal bound"
    )
    lines = [head]
    for r in rows:
        cost = f"{r['op_us']:g}us flat" if r["op_us"] is not None else r["cost"]
        i, c = r["idle_us_per_op"], r["sched_cpu_us_per_step"]
        lines.append(
            f"{r['family']:<7}{cost:<18}{r['width']:>4} {_consumer(r):<11}{'on' if r['fuse_loop_head'] else 'off':<6}"
            f"{r.get('transport', 'streams'):<8}{r['eta']:>6.3f}{r['of_ideal']:>9.3f}"
            f"{r['tokens_per_s']:>9.0f}{r['mean_depth']:>6.2f}{r['mean_loop_op_us']:>8.0f}"
            f"{i['op_arrived_late']:>7.0f}{i['fences']:>7.0f}{i['stage_preparation']:>6.0f}"
            f"{r['reaction_us']['p50']:>7.0f}  {c['plan']:6.0f} {c['submit']:6.0f} {c['dispatch']:6.0f} "
            f"{c['engine_other']:5.0f} {c['other_threads']:6.0f}  {r['loop_stage_cpu_us_per_op']:10.0f}"
            f"  {r['host']['busy']:10.2f} {r['host']['steal']:5.2f} {r['host']['eta_bound']:5.2f}"
        )
    split = [r for r in rows if r.get("reaction_split_us")]
    if split:  # (in-process points on rings)
        lines.append(
            "reaction split, p50 / mean us: stage reply, ring, to the engine thread, engine (plan + send); "
            "the engine's CPU to send a loop op"
        )
        for r in split:
            parts = "  ".join(
                f"{p['p50']:.0f} / {p['mean']:.0f}" if p else "-" for p in r["reaction_split_us"].values()
            )
            lines.append(f"{r['family']:<7}{r['op_us'] or r['cost']!s:<8}w{r['width']:<4} {parts}")
    return "\n".join(lines)


def write_outputs(summary: dict[str, Any], out: Path) -> list[Path]:
    """``hostpath.json`` and ``eta.png``: the loop stage's busy fraction against the loop op time, per family,
    width and consumer."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in summary.get("medians") or summary["points"]:  # (with rounds: each point's median)
        if r["op_us"] is None:
            continue
        fused = "fused" if r["fuse_loop_head"] else "head op"
        n = r.get("frontends", 0)
        fronts = f" {n} front end{'s' if n > 1 else ''}" if n else ""
        label = f"{r['family']} w{r['width']} {r['consumer']}{fronts} {fused} {r.get('transport', 'streams')}"
        xs, ys = series.setdefault(label, ([], []))
        xs.append(r["op_us"])
        ys.append(r["eta"]["median"] if isinstance(r["eta"], dict) else r["eta"])
    paths = [outputs.write_json(out, "hostpath", summary)]
    if series:
        paths.append(
            outputs.lines(
                out / "eta.png",
                "loop stage busy fraction on synthetic stages",
                series,
                "loop op time (µs)",
                "eta (modelled device time / wall)",
            )
        )
    return paths
