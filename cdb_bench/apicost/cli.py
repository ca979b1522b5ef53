"""``cdb bench apicost``: where each output token's CPU goes when it is served through the public API.

A ``cdb serve`` tree (the shipped model, or ``--synthetic-cost`` stages that model a GPU's device time) under a
closed-loop load of ``--concurrency`` streams from another process (``--client own``: a minimal HTTP/1.1 SSE or
gRPC client; ``guidellm``: the GuideLLM benchmark client against ``/v1/completions``), fixed lengths
(``--prompt-tokens``, ``--output-tokens``, ``ignore_eos``). Over a steady window it reads each serving process's
CPU (front ends, scheduler, each stage; the client's is not counted) per output token, and with ``--profile`` the
activities it goes to, sampled by py-spy in a second window (``cdb_bench.apicost.activities``). Every point runs
``--rounds`` times, the points interleaved round by round; the figures are medians. Prints a table; ``--json``
prints the JSON; ``--out DIR`` writes ``apicost.json`` and ``apicost.png`` (a stacked bar of CPU per token per
process and activity, for the first point with activities).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cdb_bench.apicost.measure import Point, Window, run_point
from cdb_bench.outputs import progress, write_json
from cdb_bench.stats import median
from cdb_model.loader import DEFAULT_MODEL


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdb bench apicost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--synthetic-cost", default="", metavar="SPEC", help="synthetic stages, e.g. h200:ouro-1.4b")
    p.add_argument("--modes", nargs="+", default=["cdb"], choices=["cdb", "full-depth", "no-refill"])
    p.add_argument("--api", nargs="+", default=["http"], choices=["http", "grpc"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[64])
    p.add_argument("--frontends", nargs="+", default=[""], help="CDB_FRONTENDS per point (default: auto)")
    p.add_argument("--speculative", nargs="+", default=["auto"], choices=["auto", "on", "off"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=96)
    p.add_argument("--seconds", type=float, default=10.0, help="steady window per point")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds before the window")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="sample the activities with py-spy (a second window)")
    p.add_argument("--client", default="own", choices=["own", "guidellm"])
    p.add_argument("--guidellm", default="guidellm", help="the guidellm command (--client guidellm)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--no-progress", action="store_true")
    return p


def points(args: argparse.Namespace) -> list[Point]:
    return [
        Point(
            model=args.model,
            mode=mode,
            api="http" if args.client == "guidellm" else api,
            concurrency=c,
            synthetic_cost=args.synthetic_cost,
            speculative=spec,
            frontends=fe,
            max_num_seqs=args.max_num_seqs,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            client=args.client,
        )
        for c, api, fe, spec, mode in itertools.product(
            args.concurrency, args.api, args.frontends, args.speculative, args.modes
        )
    ]


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over a point's rounds (each figure, each process's CPU, each activity)."""
    first = runs[0]
    out: dict[str, Any] = {"point": first["point"], "rounds": len(runs)}
    out["tokens_per_s_by_round"] = [r["tokens_per_s"] for r in runs]
    for key in ("tokens_per_s", "mean_depth", "serving_cpu_us_per_token", "client_cpu_us_per_token"):
        out[key] = median(r[key] for r in runs)
    out["cpu_us_per_token"] = {p: median(r["cpu_us_per_token"][p] for r in runs) for p in first["cpu_us_per_token"]}
    sampled = [r["activities"] for r in runs if "activities" in r]
    if sampled:
        procs = {p for s in sampled for p in s}
        out["activities"] = {
            p: {
                a: median(s.get(p, {}).get(a, 0.0) for s in sampled) for a in {a for s in sampled for a in s.get(p, {})}
            }
            for p in sorted(procs)
        }
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    procs = sorted({p for r in rows for p in r["cpu_us_per_token"]})
    head = f"{'point':<28}{'tok/s':>9}{'depth':>7}{'serving':>9}{'client':>9}" + "".join(
        f"{p[-13:]:>14}" for p in procs
    )
    lines = [head, "CPU per output token (µs), medians"]
    for r in rows:
        cpu = r["cpu_us_per_token"]
        line = f"{r['point']:<28}{r['tokens_per_s']:>9.0f}{r['mean_depth']:>7.2f}{r['serving_cpu_us_per_token']:>9.1f}"
        line += f"{r['client_cpu_us_per_token']:>9.1f}"
        lines.append(line + "".join(f"{cpu[p]:>14.1f}" if p in cpu else f"{'-':>14}" for p in procs))
    for r in rows:
        for proc, acts in r.get("activities", {}).items():
            parts = ", ".join(f"{a} {v:.1f}" for a, v in sorted(acts.items(), key=lambda kv: -kv[1]) if v >= 0.5)
            lines.append(f"  {r['point']} {proc}: {parts}")
    return "\n".join(lines)


def plot(path: Path, row: dict[str, Any]) -> Path:
    from cdb_bench.outputs import _pyplot

    plt = _pyplot()
    acts = row["activities"]
    procs = list(acts)
    names = sorted({a for p in procs for a in acts[p]}, key=lambda a: -sum(acts[p].get(a, 0.0) for p in procs))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bottom = [0.0] * len(procs)
    for name in names:
        values = [acts[p].get(name, 0.0) for p in procs]
        ax.bar(procs, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("CPU per output token (µs)")
    ax.set_title(f"where a token's CPU goes: {row['point']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    beside = Path(sys.executable).with_name("py-spy")  # (the virtual environment's, when it is not on PATH)
    pyspy = shutil.which("py-spy") or (str(beside) if beside.exists() else "py-spy")
    window = Window(args.warmup, args.seconds, args.profile, pyspy, args.guidellm)
    todo = points(args)
    runs: dict[str, list[dict[str, Any]]] = {p.label(): [] for p in todo}
    steps = [(r, p) for r in range(args.rounds) for p in todo]
    for r, point in progress(steps, len(steps), "apicost", not args.no_progress):
        runs[point.label()].append(run_point(point, Window(**{**_fields(window), "seed": r})))
    rows = [summarize(runs[p.label()]) for p in todo]
    result = {"model": args.model, "synthetic_cost": args.synthetic_cost, "client": args.client, "points": rows}
    print(json.dumps(result, indent=2) if args.json else table(rows))
    if args.out is not None:
        write_json(args.out, "apicost", result)
        profiled = [r for r in rows if "activities" in r]
        if profiled:
            plot(args.out / "apicost.png", profiled[0])
    return 0


def _fields(window: Window) -> dict[str, Any]:
    return {f: getattr(window, f) for f in window.__dataclass_fields__}
