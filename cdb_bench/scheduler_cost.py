"""``cdb bench scheduler``: the scheduler's own CPU per loop step, against the loop step's compute.

The scheduler runs alone against instant stages (every op completes the moment it is polled), in steady state:
``--max-num-seqs`` resident requests with replayed depths, a new request arriving as each one ends. Its thread CPU
in ``schedule()`` and ``on_result()`` per loop step is divided by the time one real loop step over that many
tokens takes on the model (``cdb_bench.step_time.LoopStepTimer``), timed after each eighth of the steady window and
set against that eighth's planning (the median of the eight ratios: a shared machine's speed drifts by minutes).
Planning overlaps with compute on its own thread, so this fraction is what it costs on the CPU, not latency.

``--exits live --fuse-loop-head on`` plans as a deployed Ouro does: the gate's one-ahead exit decisions on signals
the instant loop stage answers (each token leaves at a depth drawn with mean ``--depth-mean``, as on synthetic
stages), and the head of the tokens that left in the next loop op.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import cdb_scheduler
from cdb_bench import outputs
from cdb_bench.step_time import LoopStepTimer
from cdb_bench.workload import depth_sampler
from cdb_engine.synthetic import SyntheticDepths, exit_signals
from cdb_model.presets import preset_config
from cdb_scheduler.config import Mode, SchedulerConfig
from cdb_scheduler.exit_policy import Horizon, OuroHazard, ReplayDepth
from cdb_scheduler.plan import HeadOp, LoopOp, Stage, StageOp, StageResult
from cdb_scheduler.request import Finished, Request
from cdb_scheduler.scheduler import Scheduler


class InstantStages:
    """Completes every op when polled, in submission order; no model (a head op samples token 5). With ``depths``, a
    decode loop op answers exit signals that make each token leave at its drawn depth (``exit_signals``)."""

    concurrent_stages = False  # in submission order

    def __init__(self, depths: SyntheticDepths | None = None, max_depth: int = 1) -> None:
        self.queue: deque[StageOp] = deque()
        self.depths, self.max_depth = depths, max_depth
        self._done = [-1, -1, -1]  # last op polled, per stage

    def submit(self, op: StageOp) -> None:
        self.queue.append(op)

    def completed(self, stage: Stage) -> int:
        return self._done[stage]

    def poll(self, timeout: float | None) -> StageResult | None:
        if not self.queue:
            return None
        op = self.queue.popleft()
        self._done[op.stage] = op.seq
        if isinstance(op, LoopOp):
            sampled = (5,) * len(op.head.rows) if op.head is not None else ()
            if op.prefill:
                return StageResult(Stage.LOOP, op.seq, 0.0, token_ids=sampled)
            signals = (0.0,) * len(op.rows)
            if self.depths is not None:
                signals = exit_signals(self.depths, op.rids, op.positions, op.steps, self.max_depth)
            return StageResult(Stage.LOOP, op.seq, 0.0, signals=signals, lookahead=signals, token_ids=sampled)
        if isinstance(op, HeadOp):
            return StageResult(Stage.HEAD, op.seq, 0.0, token_ids=(5,) * sum(op.sample))
        return StageResult(op.stage, op.seq, 0.0)


def scheduler_cpu_per_step(
    max_num_seqs: int,
    max_depth: int,
    steps: int,
    depth_mean: float,
    seed: int = 0,
    mode: Mode = Mode.CDB,
    probe: Callable[[], float] | None = None,
    chunks: int = 8,
    *,
    live: bool = False,
    fused: bool = False,
) -> dict[str, Any]:
    """Drive a scheduler for ``steps`` decode loop steps in steady state; its CPU seconds per loop step. With
    ``probe`` (the reference step's time in ms), the steady window is cut into ``chunks``, ``probe`` runs after
    each, and each chunk's planning CPU per step is divided by the step time measured right after it: on a machine
    whose speed drifts, both sides of every ratio come from the same minute (``chunk_ratios``; their median).
    ``live``: exits decided by the Ouro gate (one step ahead) on the stages' signals, instead of replayed depths;
    ``fused``: exited tokens sampled by the next loop op (``fuse_loop_head``)."""
    rng = random.Random(seed)
    draw = depth_sampler(rng, depth_mean, 1, max_depth)
    cfg = SchedulerConfig(
        max_depth=max_depth,
        mode=mode,
        max_num_seqs=max_num_seqs,
        num_kv_blocks=max_num_seqs * 64,
        kv_block_size=16,
        fuse_refill_embed=fused,
        fuse_loop_head=fused,
    )
    drawn = SyntheticDepths(depth_mean, min(2, max_depth)) if live else None  # (one step ahead: none leave at 1)
    sched, stages = Scheduler(cfg), InstantStages(drawn, max_depth)
    next_rid = 0

    def arrive() -> None:
        nonlocal next_rid
        next_rid += 1
        n = rng.randint(64, 256)
        prompt = [3] * rng.randint(16, 64)
        if live:
            req = Request(next_rid, prompt, n, OuroHazard(0.5, max_depth, 1, Horizon.ONE_AHEAD))
        else:
            req = Request(next_rid, prompt, n, ReplayDepth(max_depth), replay_depths=[draw() for _ in range(n)])
        sched.add(req)

    for _ in range(max_num_seqs * 2):
        arrive()
    warm: tuple[float, int] | None = None
    marks: list[tuple[float, int]] = []  # (planning CPU, loop steps) at each chunk boundary
    ratios: list[float] = []
    probes: list[float] = []
    chunk = max(1, (steps - steps // 10) // chunks)
    while sched.stats.loop_steps < steps:
        for op in sched.schedule():
            stages.submit(op)
        res = stages.poll(None)
        if res is None:
            continue
        for ev in sched.on_result(res):
            if isinstance(ev, Finished):
                arrive()
        st = sched.stats
        if warm is None:
            if st.loop_steps >= steps // 10:  # past the admission ramp
                warm = (st.sched_cpu_s, st.loop_steps)
                marks.append(warm)
        elif probe is not None and st.loop_steps - marks[-1][1] >= chunk:
            cpu, n = st.sched_cpu_s - marks[-1][0], st.loop_steps - marks[-1][1]
            probes.append(probe())
            ratios.append(1e3 * cpu / n / probes[-1])
            marks.append((st.sched_cpu_s, st.loop_steps))
    assert warm is not None
    cpu, n = sched.stats.sched_cpu_s - warm[0], sched.stats.loop_steps - warm[1]
    st = sched.stats
    out: dict[str, Any] = {"sched_cpu_s_per_step": cpu / n, "occupancy": st.occupancy, "loop_steps": n}
    out["mean_depth"] = st.mean_depth
    if ratios:
        out |= {"chunk_ratios": ratios, "chunk_step_ms": probes, "ratio_median": statistics.median(ratios)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cdb bench scheduler", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--model", default="ouro-bench", help="preset whose loop step is the reference")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--depth-mean", type=float, default=2.5)
    p.add_argument(
        "--exits", choices=["replay", "live"], default="replay", help="replayed depths, or the Ouro gate one step ahead"
    )
    p.add_argument("--fuse-loop-head", choices=["on", "off"], default="off", help="the head in the next loop op")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, help="write scheduler.json and a plot of the planning cost per width here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    max_depth = preset_config(args.model).max_depth
    rows = []
    for width in outputs.progress(args.max_num_seqs, len(args.max_num_seqs), "widths", not args.no_progress):
        timer = LoopStepTimer(args.model, tokens=width)
        live, fused = args.exits == "live", args.fuse_loop_head == "on"
        probe = partial(timer.ms, 5)
        fig = scheduler_cpu_per_step(width, max_depth, args.steps, args.depth_mean, probe=probe, live=live, fused=fused)
        if "ratio_median" not in fig:  # a window too short for one chunk: one step time for all of it
            step_ms = timer.ms()
            fig |= {"chunk_step_ms": [step_ms], "ratio_median": 1e3 * fig["sched_cpu_s_per_step"] / step_ms}
        fig.update(max_num_seqs=width, loop_step_ms=statistics.median(fig["chunk_step_ms"]))
        fig["sched_cpu_over_step_compute"] = fig["ratio_median"]
        rows.append(fig)
    summary = {"model": args.model, "depth_mean": args.depth_mean, "exits": args.exits, "widths": rows}
    summary["fuse_loop_head"] = args.fuse_loop_head == "on"
    summary["native_scheduler"] = cdb_scheduler.NATIVE  # compiled (mypyc) or interpreted: ``cdb native status``
    if args.out:
        outputs.write_json(args.out, "scheduler", summary)
        labels = [str(r["max_num_seqs"]) for r in rows]
        ratios = [r["sched_cpu_over_step_compute"] for r in rows]
        title = f"planning CPU per loop step / the step's compute ({args.model})"
        outputs.bars(args.out / "scheduler.png", title, labels, ratios, "ratio (width on x)", line=(0.01, "1 % goal"))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"model {args.model}  depth mean {args.depth_mean}  exits {args.exits}  fused head {args.fuse_loop_head}")
        print(f"{'max_num_seqs':>12} {'sched µs/step':>14} {'step ms':>8} {'ratio':>7} {'occupancy':>9}")
        for r in rows:
            print(
                f"{r['max_num_seqs']:>12} {1e6 * r['sched_cpu_s_per_step']:>14.1f} {r['loop_step_ms']:>8.2f} "
                f"{r['sched_cpu_over_step_compute']:>7.4f} {r['occupancy']:>9.3f}"
            )
    return 0
