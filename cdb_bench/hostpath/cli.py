"""``cdb bench hostpath``: does the host path of a loop step fit inside a GPU step? Measured on synthetic stages.

The real deployed tree (three stage processes on the real transport: shared bank, fences, gRPC streams) runs on
synthetic stages (``cdb_engine.synthetic``: everything but the model's arithmetic, which becomes modelled device
time), in steady state: a closed loop of ``concurrency`` requests (new ones as old ones end) with live exit
decisions from the stages' drawn depths. Tokens are consumed two ways:

- ``in-process``: the scheduler runs in this process (``Engine`` over ``GrpcExecutor``), token ids go to sinks here
  (``submit(detokenize=False)``: text is a front end's work, which this consumer stands in for);
- ``api``: the whole tree with its scheduler process; streaming clients in another process over the public
  gRPC API;
- ``http``: the same over the HTTP API (server-sent events, the ``openai`` client).

With ``api`` and ``http``, ``--frontends N ...`` runs the tree with N front-end processes (``CDB_FRONTENDS``; 0:
the scheduler process serves the API) and reports their CPU per streamed token.

Per point (family x loop op time x width x consumer), over the steady window:

- ``eta``: the loop stage's busy fraction, modelled device time / wall time (from the loop stage's per-op
  timeline, ``CDB_STAGE_OP_LOG``);
- tokens/s, and against the ideal ``width / (mean depth x mean loop op time)`` (a busy loop stage at full width);
- the loop stage's idle time between ops, by cause: the op arrived late (the scheduler's host path), its fences
  (the head or prelude op it waits on), its preparation on the stage; the reaction time from an op's end to the
  arrival of the op that its reply lets the scheduler plan (``loop_pipeline_depth`` later), and, in-process on
  rings, that reaction split by hand-over (``reaction_split``: the stage's reply, the ring, the hop to the engine
  thread, the engine's planning and sending);
- the scheduler process's CPU per loop step, split by part: planning, submitting ops (transport on the engine
  thread), dispatching tokens (streaming on the engine thread), the engine thread's rest, and the process's other
  threads (gRPC transport threads; with ``api`` also the public front end); and the loop stage process's CPU per
  loop op (``loop_stage_cpu_us_per_op``: on a host with few cores, what it takes from the others);
- the machine's CPU over the window (``host``, from ``/proc/stat``: every process, the clients too): the fraction
  of its cores busy, the fraction stolen by a hypervisor, the CPU per loop op, and the busy fraction its cores could
  sustain at that cost (``eta_bound``: cores x mean loop op time / CPU per loop op, at most 1) — where η is far
  below it, the loop waits on a chain of hand-overs, not on the CPU as a whole.

Op times: the loop op costs ``OP`` µs flat (nearly flat in the batch, as on a GPU below saturation); the head
and prelude ops cost what the family's ``h200`` profile gives them relative to its loop op. ``--profiles`` adds
points on the named profiles themselves (``h200:ouro-1.4b``, ``h200:huginn-3.5b``: cost grows with tokens and
context).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import cdb_scheduler
from cdb_bench import outputs
from cdb_bench.hostpath.consumers import run_api, run_in_process
from cdb_bench.hostpath.points import CONSUMERS, FAMILIES, Point, engine_config, points
from cdb_bench.hostpath.report import median_table, medians, table, write_outputs
from cdb_bench.hostpath.timeline import loop_timeline
from services.launcher import start_stages
from services.settings import load_settings


def run_point(point: Point, warmup_s: float, seconds: float, seed: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cdb-oplog-") as op_log:  # (the stages' op logs, read once)
        if point.consumer in ("api", "http"):
            fig = run_api(point, warmup_s, seconds, seed, op_log)
        else:
            rings = point.transport == "rings"
            settings = dataclasses.replace(load_settings(), stage_op_log=op_log, stage_rings=rings)
            env = {**os.environ, "CDB_STAGE_OP_LOG": op_log}
            with start_stages(engine_config(point), settings=settings, env=env) as tree:
                fig = run_in_process(point, tree, warmup_s, seconds, seed)
        depth = engine_config(point).loop_pipeline_depth
        fig |= loop_timeline(op_log, fig.pop("window"), depth, fig.pop("hops", None))
    host = fig["host"]  # at what a loop op now costs the machine's CPU, how busy its cores could keep the loop stage
    host["eta_bound"] = min(1.0, host["cores"] * fig["mean_loop_op_us"] / max(1e-9, host["cpu_us_per_op"]))
    fig["ideal_tokens_per_s"] = point.width / max(1e-9, fig["mean_depth"] * fig["mean_loop_op_us"] / 1e6)
    fig["of_ideal"] = fig["tokens_per_s"] / fig["ideal_tokens_per_s"]
    where = {"family": point.family, "cost": point.cost, "op_us": point.op_us, "width": point.width}
    how = {"consumer": point.consumer, "fuse_loop_head": point.fuse_loop_head, "transport": point.transport}
    how["frontends"] = point.frontends
    return where | how | fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cdb bench hostpath", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=["ouro", "huginn"])
    p.add_argument("--op-us", nargs="+", type=float, default=[250, 500, 1000, 2000], help="loop op times (µs)")
    p.add_argument("--widths", nargs="+", type=int, default=[32, 64, 128])
    p.add_argument("--consumers", nargs="+", choices=CONSUMERS, default=["in-process", "api"])
    p.add_argument("--no-profiles", dest="profiles", action="store_false", help="skip the named profiles")
    p.add_argument(
        "--fuse-loop-head",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="Ouro's head in the loop op (engine option --fuse-loop-head); both: side by side",
    )
    p.add_argument(
        "--transport",
        nargs="+",
        choices=("rings", "streams"),
        default=["rings"],
        help="the stage data plane (CDB_STAGE_RINGS): shared-memory rings or the gRPC streams; both: side by side",
    )
    p.add_argument(
        "--frontends",
        nargs="+",
        type=int,
        default=[0],
        help="api, http: front-end processes (CDB_FRONTENDS; 0: the scheduler serves the API); several: side by side",
    )
    p.add_argument("--seconds", type=float, default=3.0, help="steady window per point")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds before the window (admission ramp)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every point this many times, interleaved (round by round); medians and ranges per point",
    )
    p.add_argument("--quick", action="store_true", help="ouro, 500 µs, width 64, both consumers, short windows")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, help="write hostpath.json and eta.png here")
    args = p.parse_args(argv)
    args.fuse_loop_head = [v == "on" for v in args.fuse_loop_head]
    if args.quick:
        args.families, args.op_us, args.widths, args.profiles = ["ouro"], [500.0], [64], False
        args.seconds, args.warmup = min(args.seconds, 1.5), min(args.warmup, 1.0)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    todo = [(r, point) for r in range(args.rounds) for point in points(args)]  # round by round: drift hits all alike
    rows = []
    for r, point in outputs.progress(todo, len(todo), "hostpath", enabled=not args.json):
        rows.append(run_point(point, args.warmup, args.seconds) | {"round": r})
    summary: dict[str, Any] = {"points": rows, "seconds": args.seconds, "warmup_s": args.warmup}
    summary["native_scheduler"] = cdb_scheduler.NATIVE
    if args.rounds > 1:
        summary["rounds"], summary["medians"] = args.rounds, medians(rows)
    text = table(rows) + ("\n" + median_table(summary["medians"]) if args.rounds > 1 else "")
    print(json.dumps(summary, indent=2) if args.json else text)
    if args.out:
        for path in write_outputs(summary, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
