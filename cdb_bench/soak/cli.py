"""``cdb bench soak``: many requests through replicas of the real process tree while stages and schedulers are
killed and stages frozen at random.

    cdb bench soak --replicas 3 --requests 10000 --kill-every 5 --freeze-every 30 --kill-scheduler-every 20 --out soak
    cdb bench soak --quick --out soak-quick        # the CI form (tests/bench/test_soak.py): 2 replicas, 120 requests

Each request is drawn once from the seed: a prompt, an output length, greedy or seeded sampling, and a fate: run
to the end, be cancelled by the client after a few tokens, or carry a short deadline. One ``AsyncClient`` over
every replica's address (round robin) streams them, resuming a stream that breaks (``resume_attempts``). Three
fault injectors run meanwhile, each on its own schedule, each hitting a random replica that is serving (one fault
at a time per replica, so that each recovery time measures one fault; a tick with every replica still recovering
waits for the first one back, ``SETTLE_S`` after it serves again; with ``--first-faults-share``, the CI form's
way, the first fault of each kind fires at a share of the requests started instead, so that it meets requests in
flight however fast the traffic runs):

- ``stage_kill``: a random stage process SIGKILLed; the tree's supervisor restarts it, the scheduler re-attaches
  it and recomputes the requests it was running;
- ``stage_freeze``: a random stage process SIGSTOPped; the scheduler's watchdog sees it stopped, SIGKILLs it, and
  the stage is restarted and its requests recomputed as for a kill;
- ``scheduler_kill``: the scheduler SIGKILLed; its supervisor restarts it on the same port (each replica listens on
  a fixed port for that reason) and the clients resume the broken streams, on another replica or the restarted one.

A fault-free reference of the same requests comes from an in-process engine, twice: in float64 (batching never
changes a token, so it is exact) and in float32, the dtype served on a CPU. The tree runs float64 by default (the
exactness proof: every token must equal the float64 reference); ``--dtype float32`` runs the served dtype, where
the run tells whether recomputation is exact too (requests in flight at a fault against those no fault touched).
Reported (JSON ``soak.json``, the recovery times per fault kind over the run ``recovery.png``):

- ``lost``: requests that ended other than as drawn (an error status, or no finish) — goal 0. A request with a
  short drawn deadline that ends ``DEADLINE_EXCEEDED`` ended as drawn (or ``complete``, if it beat its deadline);
  a cancelled one that got all its tokens before its cancel point completed as drawn;
- ``mismatched``: requests whose streamed tokens (id and served depth) differ from the reference in the tree's
  dtype (the prefix for cancelled and deadline-cut ones) — goal 0; ``mismatched_float64_reference`` and
  ``mismatched_served_dtype_reference`` against each reference, split into requests in flight at a fault and not;
- ``leaked`` once every replica is idle again — goal 0: waiting / running requests, bank rows and KV blocks each
  scheduler still counts (``Info``); ``/dev/shm`` ``cdb-*`` segments of the tree's live processes beyond the count
  right after start, segments of its dead processes not swept, and any left after the trees stopped; open fds of
  each live process beyond the count of its role right after start plus ``FD_TOLERANCE``;
- per fault kind: count, recovery time (signal -> that replica's health ``SERVING`` again) p50 / p99 / max, faults
  not recovered within 120 s; for freezes also the time to detection (health leaves ``SERVING``) and whether the
  frozen process was killed; the added latency of requests in flight at a fault: their longest gap between tokens
  (or to the first token) minus the median gap of the requests no fault touched, p50 / p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cdb_bench import outputs
from cdb_bench.processes import stop_trees
from cdb_bench.soak.faults import KINDS, Faults
from cdb_bench.soak.replicas import CHANNEL_OPTIONS, FD_TOLERANCE, Idle, Replica, start_replicas
from cdb_bench.soak.requests import SERVED_DTYPE, Outcome, Planned, plan, reference
from cdb_bench.soak.summary import Tokens, report, served_dtype_verdict, summarize
from cdb_bench.soak.traffic import drive
from cdb_engine.config import DType, EngineConfig
from clients.sync_client import Client
from services.launcher import ServeHandle

# The CI form (``--quick``): what it sets unless given on the command line.
QUICK = {
    "replicas": 2,
    "requests": 120,
    "max_tokens": 8,
    "concurrency": 16,
    "kill_every": 1.0,
    "freeze_every": 2.0,
    "kill_scheduler_every": 1.5,
    "faults_per_kind": 1,
    "first_faults_share": 0.2,
}
FULL = {
    "replicas": 3,
    "requests": 10_000,
    "max_tokens": 24,
    "concurrency": 48,
    "kill_every": 5.0,
    "freeze_every": 30.0,
    "kill_scheduler_every": 20.0,
    "faults_per_kind": 0,
    "first_faults_share": 0.0,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdb bench soak", description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("--model", default="ouro-tiny", help="preset name or checkpoint folder")
    p.add_argument(
        "--quick", action="store_true", help="the CI form: 2 replicas, 120 short requests, one fault of each kind"
    )
    p.add_argument("--replicas", type=int, help="process trees (full: 3)")
    p.add_argument("--requests", type=int, help="(full: 10000)")
    p.add_argument("--kill-every", type=float, help="seconds between stage kills (0: none; full: 5)")
    p.add_argument("--freeze-every", type=float, help="seconds between stage freezes, SIGSTOP (0: none; full: 30)")
    p.add_argument("--kill-scheduler-every", type=float, help="seconds between scheduler kills (0: none; full: 20)")
    p.add_argument("--faults-per-kind", type=int, help="at most this many faults of each kind (0: no cap; full: 0)")
    p.add_argument(
        "--first-faults-share",
        type=float,
        help="the first stage kill, scheduler kill and stage freeze fire once 1, 2 and 3 times this share of the "
        "requests have started, among requests in flight however fast they run (0: on their periods; quick: 0.2)",
    )
    p.add_argument("--concurrency", type=int, help="streams open at once, over all replicas (full: 48)")
    p.add_argument("--max-tokens", type=int, help="longest output, lengths uniform below it (full: 24)")
    p.add_argument("--cancel", type=float, default=0.05, help="fraction of requests the client cancels")
    p.add_argument("--deadline", type=float, default=0.05, help="fraction with a short deadline")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument(
        "--standby-stages",
        action="store_true",
        help="a warm standby process per stage role in every replica (CDB_STANDBY_STAGES): a lost stage is replaced "
        "at once",
    )
    p.add_argument(
        "--dtype",
        choices=[DType.FLOAT64.value, DType.FLOAT32.value],
        default=DType.FLOAT64.value,
        help="the trees' dtype: float64 proves exactness; float32 is the served dtype",
    )
    p.add_argument("--resume-attempts", type=int, default=8, help="resumes per broken stream (the client's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="HOST:PORT of the first replica, the next ones on the following ports (port 0: free ports)",
    )
    p.add_argument("--out", type=Path, help="folder for soak.json and recovery.png")
    p.add_argument("--json", action="store_true", help="print the JSON summary instead of the table")
    return p


def _resolve(args: argparse.Namespace) -> None:
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


@dataclass(slots=True)
class Phases:
    """Seconds from the start of the command at which each phase ended (``phases_s``)."""

    start: float = field(default_factory=time.monotonic)
    ended: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.ended[name] = time.monotonic() - self.start


def _engine_config(args: argparse.Namespace, dtype: DType) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=1024,
        max_waiting=max(64, args.concurrency),
    )


def _tree_env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CDB_METRICS_ADDR"}  # replicas would share its port
    env.update(CDB_HEALTH_INTERVAL_S="0.1", CDB_STAGE_KEEPALIVE_S="2", CDB_HTTP_ADDR="")
    if args.standby_stages:
        env["CDB_STANDBY_STAGES"] = "true"
    return env


def _start_with_references(
    args: argparse.Namespace, config: EngineConfig, planned: list[Planned], phases: Phases
) -> tuple[list[ServeHandle], dict[str, list[Tokens]]]:
    """The replicas' trees, started while the fault-free references are computed (both are mostly interpreter
    and torch start-up); the references per dtype. Raises the first start error once the others are stopped."""
    host, _, port = args.listen.rpartition(":")
    started: list[tuple[list[ServeHandle], list[BaseException]]] = []

    def start() -> None:
        started.append(start_replicas(config, host, int(port), args.replicas, _tree_env(args)))
        phases.mark("replicas_started")

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    refs: dict[str, list[Tokens]] = {}
    for dtype in (DType.FLOAT64, SERVED_DTYPE):
        print(f"cdb bench soak: {dtype} fault-free reference of {len(planned)} requests (in-process)", file=sys.stderr)
        refs[dtype.value] = reference(_engine_config(args, dtype), planned)
        phases.mark(f"{dtype}_reference_done")
    starter.join()
    trees, errors = started[0] if started else ([], [RuntimeError("the replicas did not start")])
    if errors:
        stop_trees(trees, 0.0)
        raise errors[0]
    return trees, refs


@dataclass(frozen=True, slots=True)
class Run:
    """What the traffic got, the faults it met, and what the replicas held once idle."""

    outs: list[Outcome]
    wall_s: float
    faults: Faults
    idle: Idle


def _soak(args: argparse.Namespace, replicas: list[Replica], planned: list[Planned], phases: Phases) -> Run:
    """Take each replica's baseline, then drive the traffic while the faults run; wait for every recovery and for
    the replicas to go idle."""
    for r in replicas:
        r.probe.wait_for_status("SERVING", timeout=60)  # connects the probe: its socket is in the baseline
        r.note_pids()
        r.base_fds = {role: n for role, n in r.fds().items() if n is not None}
        r.base_segments = r.live_segments()
    periods = {
        "stage_kill": args.kill_every,
        "stage_freeze": args.freeze_every,
        "scheduler_kill": args.kill_scheduler_every,
    }
    order = ("stage_kill", "scheduler_kill", "stage_freeze")
    share = args.first_faults_share
    first = {k: max(1, int(len(planned) * share * (i + 1))) for i, k in enumerate(order) if periods[k]} if share else {}
    faults = Faults(replicas, periods, args.faults_per_kind, args.seed, first)
    phases.mark("traffic_started")
    faults.start()
    addresses = [r.address for r in replicas]
    outs = asyncio.run(drive(addresses, planned, args.concurrency, args.resume_attempts, faults.started))
    wall = time.monotonic() - faults.t0
    phases.mark("traffic_done")
    faults.finish()
    phases.mark("faults_recovered")
    idle = Idle.of(replicas)
    phases.mark("idle_checked")
    return Run(outs, wall, faults, idle)


def _run_config(args: argparse.Namespace, config: EngineConfig, replicas: list[Replica]) -> dict[str, Any]:
    """The run's configuration as JSON values (the engine's enums as their strings)."""
    out = {
        **asdict(config),
        "replicas": args.replicas,
        "addresses": [r.address for r in replicas],
        "kill_every_s": args.kill_every,
        "freeze_every_s": args.freeze_every,
        "kill_scheduler_every_s": args.kill_scheduler_every,
        "faults_per_kind": args.faults_per_kind,
        "concurrency": args.concurrency,
        "resume_attempts": args.resume_attempts,
        "quick": args.quick,
    }
    return {k: (str(v) if not isinstance(v, int | float | bool | list | type(None)) else v) for k, v in out.items()}


def _write_outputs(out: Path, summary: dict[str, Any], replicas: int) -> None:
    """``soak.json``, and ``recovery.png``: each recovered fault's recovery time over the run, per kind."""
    outputs.write_json(out, "soak", summary)
    series = {
        kind: (
            [f["at_s"] for f in summary["fault_log"] if f["kind"] == kind and f["recovery_s"] is not None],
            [f["recovery_s"] for f in summary["fault_log"] if f["kind"] == kind and f["recovery_s"] is not None],
        )
        for kind in KINDS
    }
    series = {k: v for k, v in series.items() if v[0]}
    if series:
        title = f"fault -> SERVING again ({summary['requests']} requests, {replicas} replicas)"
        outputs.lines(out / "recovery.png", title, series, "seconds into the run", "recovery (s)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _resolve(args)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 2 or args.replicas < 1:
        print(
            "cdb bench soak: --requests, --concurrency, --replicas must be >= 1 and --max-tokens >= 2", file=sys.stderr
        )
        return 2
    config = _engine_config(args, DType(args.dtype))
    planned = plan(args.requests, args.seed, args.cancel, args.deadline, args.max_tokens)
    phases = Phases()
    trees, refs = _start_with_references(args, config, planned, phases)
    replicas = [Replica(i, t, Client(t.address, timeout=30, options=CHANNEL_OPTIONS)) for i, t in enumerate(trees)]
    try:
        run = _soak(args, replicas, planned, phases)
    finally:
        for r in replicas:
            r.probe.close()
        stop_trees(trees, 5.0)
        phases.mark("stopped")
    summary = summarize(planned, run.outs, refs, config.dtype.value, run.faults.faults, run.faults.t0)
    exact, verdict = served_dtype_verdict(summary)
    leaked, leaks = run.idle.leaks(replicas)
    summary.update(
        wall_s=run.wall_s,
        phases_s=phases.ended,
        recomputation_exact_in_served_dtype=exact,
        served_dtype_verdict=verdict,
        leaked=leaked,
        leaked_detail=leaks,
        idle={
            "fd_growth": run.idle.fd_growth,
            "fd_tolerance": FD_TOLERANCE,
            "fds_at_start": {r.index: r.base_fds for r in replicas},
            "segments_at_start_and_idle": run.idle.segments,
        },
        scheduler_counters_since_last_start=run.idle.counters,
        config=_run_config(args, config, replicas),
    )
    if args.out:
        _write_outputs(args.out, summary, args.replicas)
    ok = summary["lost"] == summary["mismatched"] == summary["leaked"] == summary["unrecovered_faults"] == 0
    print(json.dumps(summary, indent=2, default=str) if args.json else report(summary))
    return 0 if ok else 1
