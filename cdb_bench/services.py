"""Microservices vs in-process on one offline workload, in one invocation.

    cdb bench services --json

Runs the same workload (``cdb_bench.workload.make_workload``: the workload of ``cdb bench offline``) three ways:

1. ``in_process``: the engine with its in-process executor (one worker thread);
2. ``stages``: the same engine driving the three stage server PROCESSES over gRPC (shared-memory bank, fences);
3. ``public_api`` (``--public-api``): the whole deployment, scheduler process included, with every request sent
   at once through the asyncio client (replayed depths travel in the request: the tree runs with that exit rule).

``--tracing`` measures something else, the cost of tracing (``cdb_bench.tracing_cost``).

Reports throughput and its ratio to in-process, the loop stage's idle fraction (1 - loop compute / wall, from
the ``compute_s`` of the replies), and the idle round trip of the loop stage's Run stream (ping) against the mean
loop-batch compute time. ``bench_services(config, requests)`` takes any list of ``(prompt_ids, params)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cdb_bench import outputs
from cdb_bench.offline import run_mode
from cdb_bench.public_api import send_all
from cdb_bench.stats import middle, order_statistic
from cdb_bench.tracing_cost import bench_tracing, tracing_table
from cdb_bench.workload import Workload, add_workload_args, config_and_workload
from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_scheduler.plan import Stage
from services.launcher import ServeHandle, serve_all, start_stages
from services.settings import load_settings
from services.transport.executor import GrpcExecutor, GrpcExecutorFactory


def run_stages(cfg: EngineConfig, work: Workload, tree: ServeHandle) -> dict[str, float]:
    """The workload on an in-process scheduler driving the stage processes; adds the executor's counters."""
    factory = GrpcExecutorFactory(tree.stage_addrs, tree.settings)
    fig = run_mode(cfg, work, factory)
    assert factory.executor is not None
    loop = factory.executor.counters[Stage.LOOP]
    fig["loop_ops"] = loop.ops
    fig["loop_fence_wait_s"] = loop.fence_wait_s
    fig["mean_loop_op_compute_ms"] = 1e3 * loop.compute_s / max(1, loop.ops)
    fig["mean_loop_op_period_ms"] = 1e3 * fig["wall_s"] / max(1, loop.ops)
    return fig


def ping_loop_stage(cfg: EngineConfig, tree: ServeHandle, n: int) -> dict[str, float]:
    """Round trips of empty batches on an idle loop-stage Run stream."""
    ex = GrpcExecutor(Engine(cfg).setup, tree.stage_addrs, tree.settings)
    try:
        for _ in range(20):
            ex.ping(Stage.LOOP)  # warm the stream
        rtts = [ex.ping(Stage.LOOP) for _ in range(n)]
    finally:
        ex.close()
    p50, p90 = order_statistic(rtts, 0.5, math.ceil), order_statistic(rtts, 0.9, math.ceil)
    return {"p50_ms": 1e3 * p50, "p90_ms": 1e3 * p90, "mean_ms": 1e3 * statistics.fmean(rtts)}


def run_public(cfg: EngineConfig, work: Workload, warm: Workload) -> dict[str, float]:
    """The workload through the public API of the full deployment (all requests sent at once)."""
    cfg = replace(cfg, max_waiting=max(cfg.max_waiting, len(work.prompts)))
    with serve_all(cfg, "127.0.0.1:0") as tree:
        asyncio.run(send_all(tree.address, warm))
        wall, tokens = asyncio.run(send_all(tree.address, work))
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def bench_services(
    cfg: EngineConfig,
    requests: Sequence[tuple[list[int], RequestParams]],
    *,
    public_api: bool = False,
    pings: int = 200,
    repeats: int = 3,
    progress: bool = False,
) -> dict[str, Any]:
    """In-process vs stage processes (vs the public API) on ``requests``; returns the figures of the repeat
    with the median throughput ratio (the runs alternate, so a noisy neighbour hits both alike)."""
    work = Workload([list(p) for p, _ in requests], [q for _, q in requests])
    warm = Workload(work.prompts[:4], [replace(p, max_tokens=min(p.max_tokens, 4)) for p in work.params[:4]])

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    inprocs, stagess = [], []
    run_mode(cfg, warm, None)
    with start_stages(cfg) as tree:
        run_stages(cfg, warm, tree)
        for i in range(repeats):  # interleaved, so that a noisy neighbour hits both deployments alike
            say(f"[{i + 1}/{repeats}] in-process ...")
            inprocs.append(run_mode(cfg, work, None))
            say(f"[{i + 1}/{repeats}] stage processes ...")
            stagess.append(run_stages(cfg, work, tree))
        rtt = ping_loop_stage(cfg, tree, pings)
    ratios = [g["tokens_per_s"] / i["tokens_per_s"] for i, g in zip(inprocs, stagess)]
    median = middle(range(repeats), key=ratios.__getitem__)
    inproc, stages = inprocs[median], stagess[median]
    out: dict[str, Any] = {
        "model": cfg.model,
        "max_num_seqs": cfg.max_num_seqs,
        "requests": len(work.prompts),
        "output_tokens": work.output_tokens,
        "stage_threads": load_settings().stage_threads,
        "in_process": inproc,
        "stages": stages,
        "repeats": repeats,
        "throughput_ratios_stages_over_in_process": ratios,
        "throughput_ratio_stages_over_in_process": ratios[median],
        "loop_idle_fraction_stages": 1.0 - stages["loop_busy_fraction"],
        "loop_idle_fraction_in_process": 1.0 - inproc["loop_busy_fraction"],
        "loop_stream_rtt": rtt,
        "rtt_p50_over_loop_op_compute": rtt["p50_ms"] / stages["mean_loop_op_compute_ms"],
    }
    if public_api:
        say("full deployment through the public API ...")
        pub = run_public(cfg, work, warm)
        out["public_api"] = pub
        out["throughput_ratio_public_api_over_in_process"] = pub["tokens_per_s"] / inproc["tokens_per_s"]
    return out


def _table(s: dict[str, Any]) -> str:
    i, g, r = s["in_process"], s["stages"], s["loop_stream_rtt"]
    lines = [
        f"model {s['model']}  seqs {s['max_num_seqs']}  requests {s['requests']}  output tokens {s['output_tokens']}",
        f"in-process      {i['tokens_per_s']:8.1f} tok/s   loop idle {s['loop_idle_fraction_in_process']:.3f}",
        f"stage processes {g['tokens_per_s']:8.1f} tok/s   loop idle {s['loop_idle_fraction_stages']:.3f}   "
        f"ratio {s['throughput_ratio_stages_over_in_process']:.3f} (median of "
        f"{', '.join(f'{r:.3f}' for r in s['throughput_ratios_stages_over_in_process'])})",
        f"loop stream RTT p50 {r['p50_ms']:.3f} ms vs loop op compute {g['mean_loop_op_compute_ms']:.3f} ms "
        f"(period {g['mean_loop_op_period_ms']:.3f} ms)",
    ]
    pub = s.get("public_api")
    if isinstance(pub, dict):
        lines.append(
            f"public API      {pub['tokens_per_s']:8.1f} tok/s   "
            f"ratio {s['throughput_ratio_public_api_over_in_process']:.3f}"
        )
    elif pub:
        lines.append(f"public API      {pub}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cdb bench services", description=__doc__.splitlines()[0] if __doc__ else "")
    add_workload_args(p)
    p.add_argument("--pings", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each; the median ratio is reported")
    p.add_argument("--public-api", action="store_true", help="also run the full deployment via the public API")
    p.add_argument("--tracing", action="store_true", help="instead: tracing on vs off (cdb_bench.tracing_cost)")
    p.add_argument("--otlp-endpoint", help="with --tracing: export here (default: a counting sink started here)")
    p.add_argument("--sessions", type=int, default=1, help="with --tracing: fresh pairs of deployments")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, help="write services.json and a throughput plot here")
    args = p.parse_args(argv)
    cfg, work = config_and_workload(args)
    requests = list(zip(work.prompts, work.params))
    if args.tracing:
        if args.depth_mean is not None:
            p.error("--tracing runs through the public API: live exit decisions only (no --depth-mean)")
        opts = {"repeats": args.repeats, "sessions": args.sessions, "otlp_endpoint": args.otlp_endpoint}
        out = bench_tracing(cfg, requests, progress=not args.json, **opts)
        print(json.dumps(out, indent=2) if args.json else tracing_table(out))
        return 0
    opts = {"public_api": args.public_api, "pings": args.pings, "repeats": args.repeats}
    summary = bench_services(cfg, requests, progress=not args.json, **opts)
    print(json.dumps(summary, indent=2) if args.json else _table(summary))
    if args.out:
        for path in write_outputs(summary, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def write_outputs(summary: dict[str, Any], out: Path) -> list[Path]:
    """``services.json`` and ``throughput.png``: each deployment's throughput over the in-process engine's (the
    stage processes' bar spans its repeats)."""
    labels, values, spread = ["in-process"], [1.0], [(1.0, 1.0)]
    stage_ratios = summary.get("throughput_ratios_stages_over_in_process") or [
        summary["throughput_ratio_stages_over_in_process"]
    ]
    labels.append("stage processes")
    values.append(summary["throughput_ratio_stages_over_in_process"])
    spread.append((min(stage_ratios), max(stage_ratios)))
    if "throughput_ratio_public_api_over_in_process" in summary:
        labels.append("public API")
        values.append(summary["throughput_ratio_public_api_over_in_process"])
        spread.append((values[-1], values[-1]))
    title = f"{summary['model']}: {summary['requests']} requests, width {summary['max_num_seqs']}"
    return [
        outputs.write_json(out, "services", summary),
        outputs.bars(out / "throughput.png", title, labels, values, "throughput / in-process", errors=spread),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
