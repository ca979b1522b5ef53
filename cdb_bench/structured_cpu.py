"""``cdb bench structured``'s CPU point: the engine's CPU per loop step at width 64 on synthetic Ouro stages, every
request constrained against none, in a closed loop and interleaved rounds (``cdb_bench.structured``)."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from cdb_bench import outputs
from cdb_bench.hostpath.measure import cpu_self, figures, host_cpu, steady_window
from cdb_bench.hostpath.points import Point, concurrency, engine_config, random_prompt, scaled_cost
from cdb_bench.stats import median_range
from cdb_bench.structured_workload import (
    CPU_KEY,
    CPU_OP_US,
    CPU_WIDTH,
    MASKS_KEY,
    executor_factory,
    mode_params,
    request,
    valid,
)
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine
from cdb_engine.events import Event, FinishEvent, TokenEvent
from cdb_scheduler.plan import Stage
from services import heap


class ClosedLoop:
    """Keeps ``count`` requests in the engine (a new one as each ends): constrained ones, or unconstrained ones of
    the given lengths; counts tokens and failed requests on the engine thread."""

    def __init__(self, engine: Engine, count: int, max_tokens: int, lengths: Sequence[int] | None, seed: int) -> None:
        self.engine, self.rng, self.seed = engine, random.Random(seed), seed
        self.max_tokens, self.lengths = max_tokens, lengths
        self.vocab = engine.model_config.vocab_size
        self.tokens = self.submitted = self.failed = 0
        self.stopping = False
        for _ in range(count):
            self._submit()

    def _submit(self) -> None:
        if self.stopping:
            return
        n, self.submitted = self.submitted, self.submitted + 1
        if self.lengths is None:
            params = request(self.max_tokens, self.seed + n)
        else:
            params = request(self.lengths[n % len(self.lengths)], self.seed + n, None)
        self.engine.submit(random_prompt(self.rng, self.vocab), params, self._sink, force=True, detokenize=False)

    def _sink(self, ev: Event) -> None:
        if isinstance(ev, TokenEvent):
            self.tokens += 1
        elif isinstance(ev, FinishEvent):
            self.failed += ev.finish_reason == "error"
            self._submit()


def cpu_window(cfg: EngineConfig, args: argparse.Namespace, lengths: Sequence[int] | None) -> dict[str, Any]:
    """One steady window of a closed loop at the CPU point: the engine's CPU per loop step (hostpath's figures)."""
    engine = Engine(cfg, executor_factory(cfg)).start()
    heap.settle()  # as the scheduler's process does once started
    try:
        loop = ClosedLoop(engine, concurrency(cfg.max_num_seqs), args.max_tokens, lengths, args.seed)
        marks = []
        for _ in steady_window(args.warmup, args.seconds):
            st, cpu = engine.sched_stats, engine.cpu
            mark: dict[str, float] = {"t": time.perf_counter_ns(), "tokens": loop.tokens}
            mark |= {"loop_ops": st.ops[Stage.LOOP], "cpu_process": cpu_self(), "cpu_plan": st.sched_cpu_s}
            mark |= {"cpu_submit": cpu.submit_s, "cpu_dispatch": cpu.dispatch_s, "cpu_thread": cpu.thread_s}
            mark |= {"cpu_guides": threads_cpu("cdb-guides"), "cpu_stages": threads_cpu("cdb-stage-worker")}
            marks.append(mark | {"loop_stage_cpu_s": 0.0} | host_cpu())  # (the stages' CPU: ``cpu_stages``)
        loop.stopping = True
    finally:
        engine.shutdown()
    fig = figures(*marks)
    del fig["window"], fig["loop_stage_cpu_us_per_op"]
    per_step = fig["sched_cpu_us_per_step"]
    per_step["other_threads"] -= per_step["guides"] + per_step["stages"]
    per_step["scheduler_process"] = per_step["process"] - per_step["stages"]  # (stages in processes of their own)
    fig["tokens_per_loop_step"] = (marks[1]["tokens"] - marks[0]["tokens"]) / fig["loop_ops_window"]
    return fig | {"failed_requests": loop.failed}


_CPU_PARTS: dict[str, Callable[[dict[str, float]], float]] = {
    "plan": lambda f: f["plan"],
    "thread": lambda f: f["plan"] + f["submit"] + f["dispatch"] + f["engine_other"],
    "thread_and_guides": lambda f: f["plan"] + f["submit"] + f["dispatch"] + f["engine_other"] + f["guides"],
    "scheduler_process": lambda f: f["scheduler_process"],
    "process": lambda f: f["process"],
}


def threads_cpu(prefix: str) -> float:
    """CPU seconds (user + system) of this process's threads named ``prefix...`` (Linux ``/proc``)."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def cpu_ratios(c: list[dict[str, Any]], u: list[dict[str, Any]], per_token: bool) -> dict[str, Any]:
    """Each CPU part's paired ratio constrained / unconstrained, per loop step or per token: median and range."""

    def cost(f: dict[str, Any], part: Callable[[dict[str, float]], float]) -> float:
        return part(f["sched_cpu_us_per_step"]) / (f["tokens_per_loop_step"] if per_token else 1.0)

    return {k: median_range(cost(a, part) / cost(b, part) for a, b in zip(c, u)) for k, part in _CPU_PARTS.items()}


def bench_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's CPU per loop step at width 64, every request constrained against none, interleaved rounds."""
    cfg = engine_config(Point("ouro", scaled_cost("ouro", CPU_OP_US), CPU_WIDTH, "in-process", CPU_OP_US))
    with Engine(cfg, executor_factory(cfg)) as eng:  # the constrained outputs' lengths, for the unconstrained ones
        rng = random.Random(args.seed)
        prompts = [random_prompt(rng, eng.model_config.vocab_size) for _ in range(concurrency(CPU_WIDTH))]
        outs = eng.generate(prompts, mode_params("skip_on", len(prompts), args.max_tokens, args.seed))
    lengths = [len(o.token_ids) for o in outs]
    # Constrained with forced skips (the default), constrained without them (the masks alone: the same depths as
    # unconstrained, so the same tokens per step), and unconstrained, in rotating order round by round.
    runs: dict[str, list[dict[str, Any]]] = {"constrained": [], "masks_only": [], "unconstrained": []}
    order: list[tuple[str, EngineConfig, list[int] | None]] = [("constrained", cfg, None)]
    order += [("masks_only", replace(cfg, forced_skip=False), None), ("unconstrained", cfg, lengths)]
    schedule = [order[(r + k) % 3] for r in range(args.rounds) for k in range(3)]
    for name, config, lens in outputs.progress(schedule, len(schedule), "cpu", enabled=not args.no_progress):
        runs[name].append(cpu_window(config, args, lens))
    c, m, u = runs["constrained"], runs["masks_only"], runs["unconstrained"]
    where = {"cost": cfg.synthetic_cost, "model": cfg.model, "width": CPU_WIDTH, "concurrency": concurrency(CPU_WIDTH)}
    return where | {
        "rounds": args.rounds,
        "seconds": args.seconds,
        "constrained_valid_rate": sum(o.finish_reason == "stop" and valid(o.text) for o in outs) / len(outs),
        "constrained_tokens_per_output": statistics.fmean(lengths),
        CPU_KEY: cpu_ratios(c, u, per_token=False),
        "per_token_" + CPU_KEY: cpu_ratios(c, u, per_token=True),
        MASKS_KEY: cpu_ratios(m, u, per_token=False),
        "per_token_" + MASKS_KEY: cpu_ratios(m, u, per_token=True),
        "tokens_per_s_ratio": median_range(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(c, u)),
        "runs": runs,
    }
