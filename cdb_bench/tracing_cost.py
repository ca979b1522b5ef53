"""The cost of tracing: two whole deployments side by side, one with ``OTEL_TRACES_EXPORTER=none`` and one
exporting every request's trace over OTLP (default: to a counting sink, ``python -m
services.telemetry.otlp_receiver``, started here; ``--otlp-endpoint`` for another), the workload sent through the
public API to each in turn, alternating which goes first. Reports the median of the paired throughput ratios
on/off, and of the CPU time per token of each tree's processes (less sensitive to other load on the machine).

Run: ``cdb bench services --tracing --sessions 3 --repeats 5 --json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cdb_bench.processes import cpu_seconds, start_python
from cdb_bench.public_api import send_all
from cdb_bench.workload import Workload
from cdb_engine.config import EngineConfig, RequestParams
from services.launcher import ServeHandle, serve_all
from services.settings import load_settings


def tracing_env(on: bool, endpoint: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a deployment with tracing off (``OTEL_TRACES_EXPORTER=none``) or on (OTLP to
    ``endpoint``, every request sampled); other ``OTEL_*`` settings are kept; no metrics endpoint and no HTTP API
    (the two trees run at once)."""
    skip = ("CDB_METRICS_ADDR", "CDB_HTTP_ADDR")
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in skip}
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

    def cpu(pid: int) -> float:
        try:
            return cpu_seconds(pid)
        except (OSError, IndexError):
            return 0.0

    sched = cpu(tree.scheduler.pid) if tree.scheduler is not None else 0.0
    return {"scheduler": sched, "stages": sum(cpu(p.pid) for p in tree.stages.values())}


class CountingSink:
    """``python -m services.telemetry.otlp_receiver --port 0`` in a child process: an OTLP/gRPC endpoint that only
    counts the spans it receives."""

    def __init__(self) -> None:
        self.proc, line = start_python(["-m", "services.telemetry.otlp_receiver", "--port", "0"])
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
    wall, tokens = asyncio.run(send_all(tree.address, work))
    cpu1 = tree_cpu_s(tree)
    sched, stages = (cpu1[k] - cpu0[k] for k in ("scheduler", "stages"))
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "cpu_s_scheduler": sched,
        "cpu_s_stages": stages,
        "cpu_ms_per_token": 1e3 * (sched + stages) / tokens,
    }


def _session(
    cfg: EngineConfig,
    work: Workload,
    warm: Workload,
    endpoint: str,
    session: int,
    sessions: int,
    repeats: int,
    runs: dict[str, list[dict[str, float]]],
    progress: bool,
) -> None:
    """One fresh pair of deployments (off, on), started in alternating order; ``repeats`` pairs of runs."""
    order = ("off", "on") if session % 2 == 0 else ("on", "off")
    with contextlib.ExitStack() as stack:
        trees = {
            w: stack.enter_context(serve_all(cfg, "127.0.0.1:0", env=tracing_env(w == "on", endpoint))) for w in order
        }
        for tree in trees.values():
            asyncio.run(send_all(tree.address, warm))
        for i in range(repeats):
            for which in ("off", "on") if i % 2 == 0 else ("on", "off"):
                if progress:
                    where = f"session {session + 1}/{sessions}, {i + 1}/{repeats}"
                    print(f"[{where}] tracing {which} ...", file=sys.stderr, flush=True)
                runs[which].append({"session": session, **_timed_run(trees[which], work)})


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
            _session(cfg, work, warm, endpoint, session, sessions, repeats, runs, progress)
    finally:
        if sink is not None:
            received = sink.close()
    ratios = [n["tokens_per_s"] / f["tokens_per_s"] for n, f in zip(runs["on"], runs["off"])]
    cpu_ratios = [n["cpu_ms_per_token"] / f["cpu_ms_per_token"] for n, f in zip(runs["on"], runs["off"])]
    return {
        "model": cfg.model,
        "max_num_seqs": cfg.max_num_seqs,
        "requests": len(work.prompts),
        "output_tokens": work.output_tokens,
        "stage_threads": load_settings().stage_threads,
        "sessions": sessions,
        "repeats": repeats,
        "otlp_endpoint": otlp_endpoint or "counting sink (services.telemetry.otlp_receiver)",
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


def tracing_table(s: dict[str, Any]) -> str:
    med, rec = s["median_tokens_per_s"], s["sink_received"]
    return "\n".join(
        [
            f"model {s['model']}  seqs {s['max_num_seqs']}  reqs {s['requests']}  output tokens {s['output_tokens']}",
            f"tracing off  {med['off']:8.1f} tok/s (median of {len(s['tracing_off'])})",
            f"tracing on   {med['on']:8.1f} tok/s (median of {len(s['tracing_on'])})",
            f"ratio on/off {s['throughput_ratio_on_over_off']:.3f} (median of paired ratios "
            f"{', '.join(f'{r:.3f}' for r in s['throughput_ratios_on_over_off'])}; per session "
            f"{', '.join(f'{r:.3f}' for r in s['throughput_ratio_per_session'])})",
            f"CPU per token (scheduler + stages) on/off {s['cpu_per_token_ratio_on_over_off']:.3f} (median; "
            f"{s['median_cpu_ms_per_token']['off']:.3f} ms off, {s['median_cpu_ms_per_token']['on']:.3f} ms on)",
            f"sink received {rec.get('spans', '?')} spans in {rec.get('export_requests', '?')} export requests",
        ]
    )
