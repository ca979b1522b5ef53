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

from cdb_bench.hostpath.cli import main, run_point
from cdb_bench.hostpath.points import Point, points, scaled_cost
from cdb_bench.hostpath.report import medians, write_outputs
from cdb_bench.hostpath.timeline import loop_timeline, reaction_split

__all__ = [
    "Point",
    "loop_timeline",
    "main",
    "medians",
    "points",
    "reaction_split",
    "run_point",
    "scaled_cost",
    "write_outputs",
]
