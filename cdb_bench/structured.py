"""``cdb bench structured``: structured output (a JSON schema) against unconstrained output on the same prompts.

    cdb bench structured --json --out structured.json --plot structured.png
    cdb bench structured --synthetic --quick

Three modes on the same prompts (clauses of the shipped model's held-out text), seeded sampling (temperature 1)
and ``max_tokens``, interleaved round by round (order rotated) on engines kept alive, speculation off: constrained
with forced skips (``forced_skip``: a forced token is not sampled, its position exits at the minimum depth),
constrained without them, unconstrained. Per mode: the valid rate (outputs that end at a stop and parse as JSON
valid against the schema, ``jsonschema``); loop steps per token, and the mean depth of forced positions (replayed
through a fresh guide) and of free ones, token 0 (the prefill's) left out; tokens/s as each round's ratio to
unconstrained's (median and range), never a time.

And the engine's CPU per loop step at width 64, every request constrained against none (``cpu``): synthetic Ouro
stages at ``cdb bench hostpath``'s quick point (a 500 µs loop op), a closed loop (unconstrained requests as long as
the constrained ones came out), interleaved rounds; medians of the paired ratios constrained / unconstrained, for
planning, the engine thread and the process, per loop step and per token.

Synthetic stages (``--synthetic``, and the CPU point) draw each masked token among the ids its mask allows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import cdb_scheduler
from cdb_bench import outputs
from cdb_bench.hostpath.points import FAMILIES, scaled_cost
from cdb_bench.stats import median_range
from cdb_bench.structured_cpu import bench_cpu
from cdb_bench.structured_workload import (
    CPU_KEY,
    CPU_OP_US,
    MASKS_KEY,
    MODES,
    QUICK,
    SCHEMA,
    STRUCTURE,
    clauses,
    executor_factory,
    mode_params,
    valid,
)
from cdb_engine.config import EngineConfig, Speculative
from cdb_engine.engine import Completion, Engine
from cdb_engine.prepare import RequestPreparer
from cdb_model.loader import DEFAULT_MODEL


def forced_positions(prep: RequestPreparer, tokens: Sequence[int]) -> list[bool] | None:
    """Whether the grammar forced each token, replayed through a fresh guide (None: the output does not follow)."""
    guide, forced = prep.grammars.guide(STRUCTURE), []
    stops = prep.model_config.stop_token_ids
    for i, t in enumerate(tokens):
        token = guide.forced(i)
        forced.append(token >= 0)
        if token in stops and t in stops:  # the end (a stop id forced; another may have been sampled)
            continue
        if not guide.accept(i, t):
            return None
    return forced


Run = tuple[float, list[Completion], float]  # one round of a mode: wall time, outputs, mean loop batch


def mode_figures(prep: RequestPreparer, runs: list[Run], constrained: bool) -> dict[str, Any]:
    """One mode's figures over its rounds' outputs."""
    outs = [o for _, round_outs, _ in runs for o in round_outs]
    tokens = sum(len(o.token_ids) for o in outs)
    forced: list[int] = []
    free: list[int] = []
    unfollowed = 0
    for o in outs:
        marks = forced_positions(prep, o.token_ids) if constrained else [False] * len(o.token_ids)
        if marks is None:
            unfollowed += 1
            continue
        for i in range(1, len(o.token_ids)):
            (forced if marks[i] else free).append(o.depths[i])
    mean = statistics.fmean
    fig: dict[str, Any] = {
        "outputs": len(outs),
        "valid_rate": sum(o.finish_reason == "stop" and valid(o.text) for o in outs) / len(outs),
        "stop_rate": sum(o.finish_reason == "stop" for o in outs) / len(outs),
        "errors": sum(o.finish_reason == "error" for o in outs),
        "not_following_the_grammar": unfollowed if constrained else None,
        "tokens_per_output": tokens / len(outs),
        "loop_steps_per_token": sum(o.total_loop_steps for o in outs) / max(1, tokens),
        "forced_share": len(forced) / max(1, len(forced) + len(free)),
        "forced_mean_depth": mean(forced) if forced else None,
        "free_mean_depth": mean(free) if free else None,
        "mean_loop_batch": mean(batch for _, _, batch in runs),
        "tokens_per_s_rounds": [sum(len(o.token_ids) for o in r) / wall for wall, r, _ in runs],
        "sample_text": outs[0].text if outs else "",
    }
    fig["forced_over_free"] = fig["forced_mean_depth"] / fig["free_mean_depth"] if forced and free else None
    return fig


def bench_modes(base: EngineConfig, args: argparse.Namespace) -> dict[str, Any]:
    """The three modes on the same prompts, interleaved round by round on engines kept alive."""
    factory = executor_factory(base)
    engines = {m: Engine(replace(base, forced_skip=m != "skip_off"), factory).start() for m in MODES}
    try:
        prompts = clauses(args.requests)
        params = {m: mode_params(m, args.requests, args.max_tokens, args.seed) for m in MODES}
        for m, eng in engines.items():  # warm-up: the schema's compile, first calls
            eng.generate(prompts[:2], [replace(p, max_tokens=8) for p in params[m][:2]])
        schedule = [MODES[(r + k) % len(MODES)] for r in range(args.rounds) for k in range(len(MODES))]
        runs: dict[str, list[Run]] = {m: [] for m in MODES}
        for mode in outputs.progress(schedule, len(schedule), "structured", enabled=not args.no_progress):
            st = engines[mode].sched_stats
            before, t0 = (st.loop_tokens, st.loop_steps), time.perf_counter()
            outs = engines[mode].generate(prompts, params[mode])
            wall = time.perf_counter() - t0
            batch = (st.loop_tokens - before[0]) / max(1, st.loop_steps - before[1])
            runs[mode].append((wall, outs, batch))
        prep = engines["skip_on"].prep
        assert prep.grammars.forced_skip, "forced skips are off under this KV policy"
        modes = {m: mode_figures(prep, runs[m], m != "unconstrained") for m in MODES}
    finally:
        for eng in engines.values():
            eng.shutdown()
    ref = modes["unconstrained"]["tokens_per_s_rounds"]
    for m in MODES:
        ratios = [a / b for a, b in zip(modes[m]["tokens_per_s_rounds"], ref)]
        modes[m]["tokens_per_s_ratio"] = median_range(ratios) | {"rounds": ratios}
    return modes


def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or (FAMILIES["ouro"][0] if args.synthetic else DEFAULT_MODEL)
    cost = scaled_cost("ouro", CPU_OP_US) if args.synthetic else ""
    base = EngineConfig(model=model, synthetic_cost=cost, max_num_seqs=args.max_num_seqs, speculative=Speculative.OFF)
    modes = bench_modes(base, args)
    on, off = modes["skip_on"], modes["skip_off"]
    return {
        "bench": "structured",
        "model": model,
        "synthetic_cost": cost,
        "schema": SCHEMA,
        "requests": args.requests,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs,
        "sampling": {"temperature": 1.0, "seed": args.seed},
        "native_scheduler": cdb_scheduler.NATIVE,
        "valid_rate": {"constrained": on["valid_rate"], "unconstrained": modes["unconstrained"]["valid_rate"]},
        "forced_over_free": {"skip_on": on["forced_over_free"], "skip_off": off["forced_over_free"]},
        "tokens_per_s_ratio": {m: modes[m]["tokens_per_s_ratio"]["median"] for m in ("skip_on", "skip_off")},
        "modes": modes,
        "cpu": bench_cpu(args),  # (cdb_bench.structured_cpu)
    }


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def table(s: dict[str, Any]) -> str:
    lines = [
        f"{s['model']}{' (synthetic ' + s['synthetic_cost'] + ')' if s['synthetic_cost'] else ''}: "
        f"{s['requests']} requests x {s['rounds']} rounds, max_tokens {s['max_tokens']}, width {s['max_num_seqs']}",
        f"{'mode':<14}{'valid':>7}{'stop':>7}{'tok/out':>8}{'steps/tok':>10}{'forced':>8}"
        f"{'d forced':>9}{'d free':>8}{'ratio':>7}{'tok/s / unconstrained (range)':>32}",
    ]
    for m, f in s["modes"].items():
        r = f["tokens_per_s_ratio"]
        lines.append(
            f"{m:<14}{f['valid_rate']:>7.3f}{f['stop_rate']:>7.3f}{f['tokens_per_output']:>8.1f}"
            f"{f['loop_steps_per_token']:>10.3f}{f['forced_share']:>8.3f}{_num(f['forced_mean_depth'], '.2f'):>9}"
            f"{_num(f['free_mean_depth'], '.2f'):>8}{_num(f['forced_over_free']):>7}"
            f"{r['median']:>20.3f} ({r['min']:.3f}-{r['max']:.3f})"
        )
    c = s["cpu"]
    lines.append(
        f"engine CPU, constrained / unconstrained ({c['model']} {c['cost']}, width {c['width']}, {c['rounds']} "
        f"rounds; constrained outputs valid {c['constrained_valid_rate']:.3f}):"
    )
    for what, key in (("per loop step", CPU_KEY), ("per token", "per_token_" + CPU_KEY)):
        for skips, k in (("", key), (", masks only (no forced skips)", key.replace(CPU_KEY, MASKS_KEY))):
            parts = "  ".join(f"{n} {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" for n, v in c[k].items())
            lines.append(f"  {what + skips:<44}{parts}")
    return "\n".join(lines)


def plot(s: dict[str, Any], path: Path) -> Path:
    """Four panels: valid rates, forced and free depths, tokens/s against unconstrained, CPU per loop step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    modes, names = s["modes"], list(s["modes"])
    fig, ax = plt.subplots(2, 2, figsize=(10, 7))
    ax[0, 0].bar(names, [modes[m]["valid_rate"] for m in names], color="#2ca02c")
    ax[0, 0].set_ylabel("valid JSON of the schema (share)")
    for k, (key, label) in enumerate((("forced_mean_depth", "forced"), ("free_mean_depth", "free"))):
        ax[0, 1].bar([j + 0.4 * k - 0.2 for j in (0, 1)], [modes[m][key] or 0 for m in MODES[:2]], 0.4, label=label)
    ax[0, 1].set_xticks([0, 1], MODES[:2])
    ax[0, 1].set_ylabel("mean loop depth of a position")
    ax[0, 1].set_title("forced / free: " + ", ".join(f"{_num(s['forced_over_free'][m])} {m}" for m in MODES[:2]))
    ax[0, 1].legend()
    r = [modes[m]["tokens_per_s_ratio"] for m in names]
    mid = [v["median"] for v in r]
    ax[1, 0].bar(names, mid, yerr=[[m - v["min"] for m, v in zip(mid, r)], [v["max"] - m for m, v in zip(mid, r)]])
    ax[1, 0].set_ylabel("tokens/s / unconstrained (median, range)")
    c = s["cpu"][CPU_KEY]
    ax[1, 1].bar([k.replace("_", " ") for k in c], [v["median"] for v in c.values()], color="#9467bd")
    ax[1, 1].tick_params(axis="x", labelrotation=20)
    ax[1, 1].axhline(1.0, color="grey", linestyle="--")
    ax[1, 1].set_ylabel(f"CPU per loop step, w{s['cpu']['width']}: constrained / not")
    for a in ax.flat:
        a.grid(axis="y", alpha=0.3)
        for bars in a.containers:
            if isinstance(bars, BarContainer):
                a.bar_label(bars, fmt="%.3g")
    fig.suptitle(f"structured output (JSON schema): {s['model']}{' synthetic' if s['synthetic_cost'] else ''}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cdb bench structured", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--model", help=f"default {DEFAULT_MODEL} ({FAMILIES['ouro'][0]} with --synthetic)")
    p.add_argument("--synthetic", action="store_true", help="synthetic Ouro stages (a 500 µs loop op) for every mode")
    p.add_argument("--requests", type=int, default=32, help="prompts per mode and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (modes; and the CPU windows)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=32, help="width of the modes' engines (the CPU point: 64)")
    p.add_argument("--seconds", type=float, default=3.0, help="CPU point: steady window per round")
    p.add_argument("--warmup", type=float, default=1.0, help="CPU point: seconds before the window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="6 requests, 2 rounds, 1 s windows")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", type=Path, help="write the JSON here")
    p.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, min(getattr(args, key), value))
    if args.rounds < 1 or args.requests < 2:
        p.error("--rounds must be at least 1 and --requests at least 2")
    return outputs.deliver(bench(args), args, table, plot)


if __name__ == "__main__":
    raise SystemExit(main())
