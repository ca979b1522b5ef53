"""``cdb bench soak``: many requests through replicas of the real process tree while stages and schedulers are
killed and stages frozen at random.

    cdb bench soak --replicas 3 --requests 10000 --kill-every 5 --freeze-every 30 --kill-scheduler-every 20 --out soak
    cdb bench soak --quick --out soak-quick        # the CI form (tests/bench/test_soak.py): 2 replicas, 120 requests

Each request is drawn once from the seed: a prompt, an output length, greedy or seeded sampling, and a fate: run
to the end, be cancelled by the client after a few tokens, or carry a short deadline. One ``AsyncClient`` over
every replica's address (round robin) streams them, resuming a stream that breaks (``resume_attempts``). Three
fault injectors run meanwhile, each on its own schedule, each hitting a random replica that is serving (one fault
at a time per replica, so that each recovery time measures one fault; a tick with every replica still recovering
waits for the first one back, ``SETTLE_S`` after it serves again):

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

from cdb_bench.soak.cli import build_parser, main
from cdb_bench.soak.faults import KINDS

__all__ = ["KINDS", "build_parser", "main"]
