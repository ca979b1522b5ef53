"""``cdb bench offline``: full-depth, no-refill and CDB on the same seeded workload, in one invocation.

Exit depths are replayed from a distribution with a given mean, min and max (the paper's replay method: every
mode serves the same depths), or decided live by the model's gate. EOS is off, so every request emits its
drawn length. Reports throughput, each mode's ratio to full depth, the FLOP bound
S = (F0 + r_max Fr) / (F0 + d_mean Fr) and the realized fraction (ratio / S).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cdb_bench import outputs
from cdb_bench.flops import workload_flop_ratio
from cdb_bench.stats import middle, order_statistic
from cdb_bench.workload import Workload, add_workload_args, config_and_workload, make_workload
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Completion, Engine
from cdb_engine.inprocess import shared_model_factory
from cdb_engine.setup import StageSetup, torch_dtype
from cdb_model.loader import load_model
from cdb_scheduler.config import Mode
from cdb_scheduler.plan import Executor


def run_mode(
    cfg: EngineConfig, work: Workload, executor_factory: Callable[[StageSetup], Executor] | None
) -> dict[str, float]:
    """Drain the workload once on a fresh engine; returns the mode's figures."""
    with Engine(cfg, executor_factory) as eng:
        t0 = time.perf_counter()
        outs = eng.generate(work.prompts, work.params)
        wall = time.perf_counter() - t0
        st = eng.sched_stats
        s_w = workload_flop_ratio(
            eng.model_config, [len(o.prompt_ids) for o in outs], [o.depths[1:] for o in outs], eng.limits.max_depth
        )
    tokens = sum(len(o.token_ids) for o in outs)
    loop_compute = st.compute_s[1]
    fig = {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "steady_tokens_per_s": steady_throughput(outs, cfg.max_num_seqs) or tokens / wall,
        "mean_depth": st.mean_depth,
        "loop_steps": st.loop_steps,
        "occupancy": st.occupancy,
        "refill_events": st.refill_events,
        "loop_compute_s": loop_compute,
        "loop_busy_fraction": loop_compute / wall,
        "sched_cpu_per_step_over_step_time": (st.sched_cpu_s / max(1, st.loop_steps))
        / max(1e-12, loop_compute / max(1, st.loop_steps)),
        "preemptions": st.preemptions,
        "workload_flop_ratio_S_w": s_w,
    }
    fig["depth_histogram"] = {str(d): n for d, n in sorted(st.depth_hist.items())}  # type: ignore[assignment]
    return fig


def steady_throughput(outs: Sequence[Completion], width: int) -> float | None:
    """Tokens/s while every slot is busy: from the first token of the ``width``-th request to the first token of
    the last request (after it the waiting queue is empty and the drain tail begins). None if too short."""
    firsts = sorted(o.token_times[0] for o in outs if o.token_times)
    if len(firsts) <= width:
        return None
    start, end = firsts[width - 1], firsts[-1]
    n = sum(1 for o in outs for t in o.token_times if start < t <= end)
    return n / (end - start) if end > start and n else None


def bench_offline(
    base: EngineConfig,
    work: Workload,
    modes: Sequence[str] = ("full-depth", "no-refill", "cdb"),
    executor_factory: Callable[[StageSetup], Executor] | None = None,
    progress: bool = False,
    repeats: int = 1,
    decode_graphs: bool | None = None,
) -> dict[str, object]:
    """All modes on one workload; figures relative to full depth and to the FLOP bound.

    With ``repeats > 1`` the modes run interleaved (A B C A B C ...) so that drift on a shared machine hits every
    mode alike; each figure is the run with the median throughput of its mode.
    """
    if executor_factory is None:
        model = load_model(base.model, dtype=torch_dtype(base.dtype), device=base.device)
        executor_factory = shared_model_factory(model, decode_graphs)
    warm = Workload(work.prompts[:4], [replace(p, max_tokens=min(p.max_tokens, 4)) for p in work.params[:4]])
    run_mode(replace(base, mode=Mode.CDB), warm, executor_factory)  # first calls allocate and warm caches
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    schedule = [mode for _ in range(repeats) for mode in modes]  # interleaved: A B C A B C ...
    for mode in outputs.progress(schedule, len(schedule), "offline", enabled=progress):
        runs[mode].append(run_mode(replace(base, mode=Mode(mode)), work, executor_factory))
    results: dict[str, dict[str, float]] = {}
    paired: dict[str, list[float]] = {}
    for mode, rs in runs.items():
        if "full-depth" in runs:  # ratio of each run to the full-depth run of the same repeat: drift cancels
            paired[mode] = sorted(f["tokens_per_s"] / ref["tokens_per_s"] for f, ref in zip(rs, runs["full-depth"]))
        results[mode] = dict(middle(rs, key=lambda f: f["tokens_per_s"]))
        results[mode]["repeats_tokens_per_s"] = [f["tokens_per_s"] for f in rs]  # type: ignore[assignment]
    probe = Engine(base)
    f0, fr = probe.model_config.param_counts()
    r = probe.limits.max_depth
    adaptive = results.get("cdb") or results[modes[-1]]
    d = adaptive["mean_depth"]
    bound = (f0 + r * fr) / (f0 + d * fr)
    summary: dict[str, object] = {
        "model": base.model,
        "F0": f0,
        "Fr": fr,
        "F0_over_Fr": f0 / fr,
        "max_depth": r,
        "mean_depth": d,
        "flop_bound_S": bound,
        "workload_flop_ratio_S_w": adaptive["workload_flop_ratio_S_w"],
        "max_num_seqs": base.max_num_seqs,
        "requests": len(work.prompts),
        "output_tokens": work.output_tokens,
        "modes": results,
    }
    if "full-depth" in results:
        _add_ratios(results, paired, bound, adaptive["workload_flop_ratio_S_w"])
    return summary


def _add_ratios(results: dict[str, dict[str, float]], paired: dict[str, list[float]], bound: float, s_w: float) -> None:
    """Each mode's ratios to full depth (the median of the paired per-repeat ratios) and to the FLOP bounds."""
    steady_ref = results["full-depth"]["steady_tokens_per_s"]
    for mode, fig in results.items():
        ratios = paired[mode]
        fig["ratio_to_full_depth"] = order_statistic(ratios, 0.5, math.ceil)
        fig["repeats_ratio_to_full_depth"] = ratios  # type: ignore[assignment]
        fig["realized_fraction_of_S"] = fig["ratio_to_full_depth"] / bound
        fig["realized_fraction_of_S_w"] = fig["ratio_to_full_depth"] / s_w
        fig["steady_ratio_to_full_depth"] = fig["steady_tokens_per_s"] / steady_ref
        fig["steady_realized_fraction_of_S"] = fig["steady_ratio_to_full_depth"] / bound


def _table(summary: dict[str, object]) -> str:
    lines = [
        f"model {summary['model']}  F0/Fr {summary['F0_over_Fr']:.3f}  r_max {summary['max_depth']}  "
        f"mean depth {summary['mean_depth']:.2f}  FLOP bound S {summary['flop_bound_S']:.3f}",
        f"workload FLOP ratio S_w {summary['workload_flop_ratio_S_w']:.3f}  max_num_seqs {summary['max_num_seqs']}",
        f"{'mode':<11} {'tok/s':>9} {'ratio':>7} {'of S':>6} {'of S_w':>6} {'steady':>7} {'of S':>6} {'occup.':>7} "
        f"{'refills':>8} {'sched/step':>10}",
    ]
    modes = summary["modes"]
    assert isinstance(modes, dict)
    for mode, f in modes.items():
        lines.append(
            f"{mode:<11} {f['tokens_per_s']:>9.1f} {f.get('ratio_to_full_depth', 0):>7.3f} "
            f"{f.get('realized_fraction_of_S', 0):>6.3f} {f.get('realized_fraction_of_S_w', 0):>6.3f} "
            f"{f.get('steady_ratio_to_full_depth', 0):>7.3f} "
            f"{f.get('steady_realized_fraction_of_S', 0):>6.3f} {f['occupancy']:>7.3f} {f['refill_events']:>8d} "
            f"{f['sched_cpu_per_step_over_step_time']:>10.4f}"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--modes", default="full-depth,no-refill,cdb")
    p.add_argument(
        "--min-head", type=int, default=None, help="min_head_batch_size (default: 1 Ouro, max_num_seqs/4 Huginn)"
    )
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats; figures are medians")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", type=Path, help="write offline.json and PNG plots (throughput, occupancy, depths) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--cuda-graphs",
        choices=("auto", "off"),
        default="auto",
        help="decode loop ops from captured CUDA graphs (auto: on CUDA) or eager",
    )


def write_outputs(summary: dict[str, Any], out: Path) -> list[Path]:
    """``offline.json`` and the plots: throughput per mode against the FLOP bounds, loop-batch occupancy per mode,
    the adaptive mode's served-depth histogram."""
    modes: dict[str, dict[str, Any]] = summary["modes"]
    names = list(modes)
    written = [outputs.write_json(out, "offline", summary)]
    reps = [modes[m].get("repeats_tokens_per_s") or [modes[m]["tokens_per_s"]] for m in names]
    title = f"{summary['model']}: {summary['requests']} requests, width {summary['max_num_seqs']}"
    if "full-depth" in modes:
        ref = modes["full-depth"]["tokens_per_s"]
        ratios = [modes[m]["tokens_per_s"] / ref for m in names]
        spread = [(min(r) / ref, max(r) / ref) for r in reps]
        bound = (float(summary["flop_bound_S"]), f"FLOP bound S = {float(summary['flop_bound_S']):.2f}")
        written.append(
            outputs.bars(
                out / "throughput.png", title, names, ratios, "throughput / full depth's", line=bound, errors=spread
            )
        )
    else:
        values = [modes[m]["tokens_per_s"] for m in names]
        spread = [(min(r), max(r)) for r in reps]
        written.append(outputs.bars(out / "throughput.png", title, names, values, "tokens / s", errors=spread))
    occupancy = [modes[m]["occupancy"] for m in names]
    written.append(outputs.bars(out / "occupancy.png", title, names, occupancy, "mean loop-batch occupancy"))
    adaptive = "cdb" if "cdb" in modes else names[-1]
    hist = modes[adaptive].get("depth_histogram")
    if hist:
        label = f"{summary['model']} ({adaptive}): served depths, mean {float(summary['mean_depth']):.2f}"
        written.append(outputs.histogram(out / "depth_histogram.png", label, hist, "served loop depth"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cdb bench offline", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    base, work = config_and_workload(args, min_head_batch_size=args.min_head)
    graphs = None if args.cuda_graphs == "auto" else False
    summary = bench_offline(
        base, work, args.modes.split(","), progress=not args.no_progress, repeats=args.repeats, decode_graphs=graphs
    )
    print(json.dumps(summary, indent=2) if args.json else _table(summary))
    if args.out:
        for path in write_outputs(summary, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["Workload", "bench_offline", "make_workload", "run_mode"]
