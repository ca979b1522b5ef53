"""Microservices vs in-process on one offline workload, in one invocation.

    python -m services.bench_services --json            # or: cdb bench services --json

Runs the same workload (``cdb_engine.bench.make_workload``: the workload of ``cdb bench offline``) three ways:

1. ``in_process``: the engine with its in-process executor (one worker thread);
2. ``stages``: the same engine driving the three stage server PROCESSES over gRPC (shared-memory bank, fences);
3. ``public_api`` (``--public-api``): the whole deployment, scheduler process included, with every request sent
   at once through the asyncio client (live exit decisions only: replayed depths are not part of the API).

``--tracing`` measures something else, the cost of tracing: two whole deployments side by side, one with
``OTEL_TRACES_EXPORTER=none`` and one exporting every request's trace over OTLP (default: to a counting sink,
``python -m tests.telemetry.otlp_receiver``, started here; ``--otlp-endpoint`` for another), the workload sent
through the public API to each in turn, alternating which goes first; reports the median of the paired
throughput ratios on/off, and of the CPU time per token of each tree's processes (less sensitive to other load on
the machine) (``bench_tracing``).

Reports throughput and its ratio to in-process, the loop stage's idle fraction (1 - loop compute / wall, from
the ``compute_s`` of the replies), and the idle round trip of the loop stage's Run stream (ping) against the mean
loop-batch compute time. ``bench_services(config, requests)`` takes any list of ``(prompt_ids, params)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cdb_engine.bench import Workload, make_workload, run_mode
from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_scheduler.plan import Stage
from clients.async_client import AsyncClient
from clients.common import GenerateOptions
from services.grpc_executor import GrpcExecutor, GrpcExecutorFactory
from services.launcher import ServeHandle, serve_all, start_stages
from services.settings import load_settings


def _options(p: RequestParams) -> GenerateOptions:
    s = p.sampling
    opts = GenerateOptions(max_tokens=p.max_tokens, ignore_eos=p.ignore_eos, temperature=s.temperature,
                           top_k=s.top_k, top_p=s.top_p, seed=s.seed)  # fmt: skip
    if p.exit_threshold is not None:
        opts["exit_threshold"] = p.exit_threshold
    return opts


def run_stages(cfg: EngineConfig, work: Workload, tree: ServeHandle) -> dict[str, float]:
    """The workload on an in-process scheduler driving the stage processes; adds the executor's counters."""
    factory = GrpcExecutorFactory(tree.stage_addrs, load_settings())
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
    ex = GrpcExecutor(Engine(cfg).setup, tree.stage_addrs, load_settings())
    try:
        for _ in range(20):
            ex.ping(Stage.LOOP)  # warm the stream
        rtts = sorted(ex.ping(Stage.LOOP) for _ in range(n))
    finally:
        ex.close()
    return {"p50_ms": 1e3 * rtts[n // 2], "p90_ms": 1e3 * rtts[int(n * 0.9)], "mean_ms": 1e3 * statistics.fmean(rtts)}


async def _send_all(address: str, work: Workload) -> tuple[float, int]:
    async with AsyncClient(address, timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[client.generate(p, **_options(q)) for p, q in zip(work.prompts, work.params)])
        wall = time.perf_counter() - t0
    return wall, sum(len(r.tokens) for r in results)


def run_public(cfg: EngineConfig, work: Workload, warm: Workload) -> dict[str, float]:
    """The workload through the public API of the full deployment (all requests sent at once)."""
    cfg = replace(cfg, max_waiting=max(cfg.max_waiting, len(work.prompts)))
    with serve_all(cfg, "127.0.0.1:0") as tree:
        asyncio.run(_send_all(tree.address, warm))
        wall, tokens = asyncio.run(_send_all(tree.address, work))
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
    median = sorted(range(repeats), key=ratios.__getitem__)[repeats // 2]
    inproc, stages = inprocs[median], stagess[median]
    out: dict[str, Any] = {
        "model": cfg.model,
        "width": cfg.max_num_seqs,
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
        if any(p.replay_depths is not None for p in work.params):
            out["public_api"] = "skipped: replayed depths are not part of the public API"
        else:
            say("full deployment through the public API ...")
            pub = run_public(cfg, work, warm)
            out["public_api"] = pub
            out["throughput_ratio_public_api_over_in_process"] = pub["tokens_per_s"] / inproc["tokens_per_s"]
    return out


def tracing_env(on: bool, endpoint: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a deployment with tracing off (``OTEL_TRACES_EXPORTER=none``) or on (OTLP to
    ``endpoint``, every request sampled); other ``OTEL_*`` settings are kept; no metrics endpoint."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "CDB_METRICS_ADDR"}
    env.pop("OTEL_SDK_DISABLED", None)
    if on:
        env.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
        env.setdefault("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    else:
        env["OTEL_TRACES_EXPORTER"] = "none"
    return env


def tree_cpu_s(tree: ServeHandle) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the tree's scheduler and by its stages (Linux ``/proc``; 0.0
    where unreadable)."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(pid: int) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime: fields 14 and 15 of proc(5)

    sched = cpu(tree.scheduler.pid) if tree.scheduler is not None else 0.0
    return {"scheduler": sched, "stages": sum(cpu(p.pid) for p in tree.stages.values())}


class CountingSink:
    """``python -m tests.telemetry.otlp_receiver --port 0`` in a child process: an OTLP/gRPC endpoint that only
    counts the spans it receives (the test receiver; needs the source checkout)."""

    def __init__(self) -> None:
        root = Path(__file__).resolve().parents[1]
        if not (root / "tests" / "telemetry" / "otlp_receiver.py").exists():
            raise RuntimeError("the counting OTLP sink lives in tests/telemetry; pass --otlp-endpoint instead")
        cmd = [sys.executable, "-m", "tests.telemetry.otlp_receiver", "--port", "0"]
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"(http://[\w.:]+)", line)
        if found is None:
            self.proc.kill()
            raise RuntimeError(f"the OTLP sink did not start: {line!r}")
        self.endpoint = found.group(1)

    def close(self) -> dict[str, int]:
        """Stop the sink; what it received: ``{"spans": ..., "export_requests": ...}``."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        found = re.search(r"received (\d+) spans in (\d+) export requests", out or "")
        return {"spans": int(found.group(1)), "export_requests": int(found.group(2))} if found else {}


def _timed_run(tree: ServeHandle, work: Workload) -> dict[str, float]:
    cpu0 = tree_cpu_s(tree)
    wall, tokens = asyncio.run(_send_all(tree.address, work))
    cpu1 = tree_cpu_s(tree)
    sched, stages = (cpu1[k] - cpu0[k] for k in ("scheduler", "stages"))
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "cpu_s_scheduler": sched,
            "cpu_s_stages": stages, "cpu_ms_per_token": 1e3 * (sched + stages) / tokens}  # fmt: skip


def bench_tracing(
    cfg: EngineConfig,
    requests: Sequence[tuple[list[int], RequestParams]],
    *,
    repeats: int = 5,
    sessions: int = 1,
    otlp_endpoint: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Throughput with tracing on vs off through the public API of two whole deployments (scheduler + three
    stage processes each) running side by side; the workload goes to each in turn, alternating which goes
    first, so that a noisy neighbour hits both alike. ``sessions`` > 1 starts fresh pairs of deployments
    (alternating which starts first) for ``repeats`` pairs of runs each: a deployment can be a few percent faster
    than an identical one for its whole life on a shared machine, and fresh pairs average that out. Returns every
    run and the median of the paired ratios on/off (throughput, and CPU time per token of the tree's processes)."""
    work = Workload([list(p) for p, _ in requests], [q for _, q in requests])
    if any(p.replay_depths is not None for p in work.params):
        raise ValueError("replayed depths are not part of the public API: use live exit decisions")
    warm = Workload(work.prompts[:4], [replace(p, max_tokens=min(p.max_tokens, 4)) for p in work.params[:4]])
    cfg = replace(cfg, max_waiting=max(cfg.max_waiting, len(work.prompts)))
    sink = CountingSink() if otlp_endpoint is None else None
    endpoint = otlp_endpoint or (sink.endpoint if sink is not None else "")
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    received: dict[str, int] = {}
    try:
        for session in range(sessions):
            order = ("off", "on") if session % 2 == 0 else ("on", "off")
            with contextlib.ExitStack() as stack:
                trees = {w: stack.enter_context(serve_all(cfg, "127.0.0.1:0", env=tracing_env(w == "on", endpoint)))
                         for w in order}  # fmt: skip
                for tree in trees.values():
                    asyncio.run(_send_all(tree.address, warm))
                for i in range(repeats):
                    for which in ("off", "on") if i % 2 == 0 else ("on", "off"):
                        if progress:
                            print(f"[session {session + 1}/{sessions}, {i + 1}/{repeats}] tracing {which} ...",
                                  file=sys.stderr, flush=True)  # fmt: skip
                        runs[which].append({"session": session, **_timed_run(trees[which], work)})
    finally:
        if sink is not None:
            received = sink.close()
    ratios = [n["tokens_per_s"] / f["tokens_per_s"] for n, f in zip(runs["on"], runs["off"])]
    cpu_ratios = [n["cpu_ms_per_token"] / f["cpu_ms_per_token"] for n, f in zip(runs["on"], runs["off"])]
    return {
        "model": cfg.model,
        "width": cfg.max_num_seqs,
        "requests": len(work.prompts),
        "output_tokens": work.output_tokens,
        "stage_threads": load_settings().stage_threads,
        "sessions": sessions,
        "repeats": repeats,
        "otlp_endpoint": otlp_endpoint or "counting sink (tests.telemetry.otlp_receiver)",
        "tracing_off": runs["off"],
        "tracing_on": runs["on"],
        "throughput_ratios_on_over_off": ratios,
        "throughput_ratio_on_over_off": statistics.median(ratios),
        "throughput_ratio_per_session": [
            statistics.median(ratios[s * repeats : (s + 1) * repeats]) for s in range(sessions)
        ],
        "median_tokens_per_s": {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()},
        "cpu_per_token_ratios_on_over_off": cpu_ratios,
        "cpu_per_token_ratio_on_over_off": statistics.median(cpu_ratios),
        "median_cpu_ms_per_token": {k: statistics.median(r["cpu_ms_per_token"] for r in v) for k, v in runs.items()},
        "median_cpu_s_scheduler": {k: statistics.median(r["cpu_s_scheduler"] for r in v) for k, v in runs.items()},
        "sink_received": received,
    }


def _tracing_table(s: dict[str, Any]) -> str:
    med, rec = s["median_tokens_per_s"], s["sink_received"]
    return "\n".join([
        f"model {s['model']}  width {s['width']}  requests {s['requests']}  output tokens {s['output_tokens']}",
        f"tracing off  {med['off']:8.1f} tok/s (median of {len(s['tracing_off'])})",
        f"tracing on   {med['on']:8.1f} tok/s (median of {len(s['tracing_on'])})",
        f"ratio on/off {s['throughput_ratio_on_over_off']:.3f} (median of paired ratios "
        f"{', '.join(f'{r:.3f}' for r in s['throughput_ratios_on_over_off'])}; per session "
        f"{', '.join(f'{r:.3f}' for r in s['throughput_ratio_per_session'])})",
        f"CPU per token (scheduler + stages) on/off {s['cpu_per_token_ratio_on_over_off']:.3f} (median; "
        f"{s['median_cpu_ms_per_token']['off']:.3f} ms off, {s['median_cpu_ms_per_token']['on']:.3f} ms on)",
        f"sink received {rec.get('spans', '?')} spans in {rec.get('export_requests', '?')} export requests",
    ])  # fmt: skip


def _table(s: dict[str, Any]) -> str:
    i, g, r = s["in_process"], s["stages"], s["loop_stream_rtt"]
    lines = [
        f"model {s['model']}  width {s['width']}  requests {s['requests']}  output tokens {s['output_tokens']}",
        f"in-process      {i['tokens_per_s']:8.1f} tok/s   loop idle {s['loop_idle_fraction_in_process']:.3f}",
        f"stage processes {g['tokens_per_s']:8.1f} tok/s   loop idle {s['loop_idle_fraction_stages']:.3f}   "
        f"ratio {s['throughput_ratio_stages_over_in_process']:.3f} (median of "
        f"{', '.join(f'{r:.3f}' for r in s['throughput_ratios_stages_over_in_process'])})",
        f"loop stream RTT p50 {r['p50_ms']:.3f} ms vs loop op compute {g['mean_loop_op_compute_ms']:.3f} ms "
        f"(period {g['mean_loop_op_period_ms']:.3f} ms)",
    ]
    pub = s.get("public_api")
    if isinstance(pub, dict):
        lines.append(f"public API      {pub['tokens_per_s']:8.1f} tok/s   "
                     f"ratio {s['throughput_ratio_public_api_over_in_process']:.3f}")  # fmt: skip
    elif pub:
        lines.append(f"public API      {pub}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cdb bench services", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--model", default="ouro-bench")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--width", type=int, default=32, help="max resident requests (loop batch width)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    p.add_argument("--depth-mean", type=float, help="replay depths with this mean (default: live exit decisions)")
    p.add_argument("--kv-policy", default="single")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, help="torch threads of the in-process executor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pings", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each; the median ratio is reported")
    p.add_argument("--public-api", action="store_true", help="also run the full deployment via the public API")
    p.add_argument(
        "--tracing",
        action="store_true",
        help="instead: tracing on vs off, two whole deployments through the public API",
    )
    p.add_argument("--otlp-endpoint", help="with --tracing: export here (default: a counting sink started here)")
    p.add_argument("--sessions", type=int, default=1,
                   help="with --tracing: fresh pairs of deployments, --repeats pairs of runs each")  # fmt: skip
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    exit_rule = "replay" if args.depth_mean is not None else "auto"
    cfg = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.width, kv_policy=args.kv_policy,
                       exit_rule=exit_rule, num_threads=args.threads)  # fmt: skip
    probe = Engine(cfg)
    depth = (args.depth_mean, 1, probe.limits.max_depth) if args.depth_mean is not None else None
    work = make_workload(vocab=probe.model_config.vocab_size, num_requests=args.requests,
                         prompt_len=tuple(args.prompt_len), output_len=tuple(args.output_len), depth=depth,
                         seed=args.seed)  # fmt: skip
    requests = list(zip(work.prompts, work.params))
    if args.tracing:
        if args.depth_mean is not None:
            p.error("--tracing runs through the public API: live exit decisions only (no --depth-mean)")
        out = bench_tracing(cfg, requests, repeats=args.repeats, sessions=args.sessions,
                            otlp_endpoint=args.otlp_endpoint, progress=not args.json)  # fmt: skip
        print(json.dumps(out, indent=2) if args.json else _tracing_table(out))
        return 0
    summary = bench_services(cfg, requests, public_api=args.public_api,
                             pings=args.pings, repeats=args.repeats, progress=not args.json)  # fmt: skip
    print(json.dumps(summary, indent=2) if args.json else _table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
