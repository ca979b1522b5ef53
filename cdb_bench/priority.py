"""``cdb bench priority``: request priorities under 2x overload: FIFO, priority, priority with depth, side by side.

    cdb bench priority --json --out priority.json --plot priority.png
    cdb bench priority --no-synthetic --quick

In this process (``cdb bench serve``'s in-process target and open-loop client), speculation off, on synthetic Ouro
stages by default (``cdb bench hostpath``'s 500 µs loop op; ``--no-synthetic``: the shipped model). Requests are
``cdb bench serve``'s Alpaca-like ones (seeded prompts and lengths, Poisson arrivals, live depths), each of the top
class (priority 0) with probability ``--top-share``, else of the low class (priority 1). First the capacity:
completed requests/s of a closed loop at full width (its steady part: the first and last ``width`` finishes left
out). Then interleaved rounds (order rotated), each on its own seeded requests:

- ``light``: ``--light-requests`` at ``--light`` x capacity; the top class's TTFTs of every round are the reference.
- at ``--overload`` x capacity for ``--seconds`` (then drained, so every TTFT is known), the same requests under
  ``fifo`` (every request at priority 0: the classes only labelled), ``priority`` (their priorities) and
  ``priority_depth`` (and ``EngineConfig.priority_depth = --floor``).

Per policy: the top class's TTFT p50 and p90 over the light load's p50; completed requests/s and tokens/s in the
window, overall and per class, over FIFO's in the same round; the mean served depth per class (the window's tokens,
token 0 left out); the engine's waiting requests at the window's end. Ratios are medians over rounds (and ranges).
Synthetic stages exit each token at its drawn depth whatever the threshold, so there ``priority_depth`` changes no
depth; the shipped model shows the trade.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import cdb_scheduler
from cdb_bench import outputs
from cdb_bench.hostpath.points import FAMILIES, concurrency, scaled_cost
from cdb_bench.priority_report import POLICIES, Round, Run, plot, summarize, table
from cdb_bench.serve.arrivals import Arrival
from cdb_bench.serve.driver import drive
from cdb_bench.serve.lengths import DATASETS
from cdb_bench.serve.options import parse_with_quick
from cdb_bench.serve.requests import RequestSet, ServeRequest, make_requests, warmup_requests
from cdb_bench.serve.targets import InProcessConnection, InProcessTarget, open_target
from cdb_engine.config import EngineConfig, RequestParams, Speculative
from cdb_engine.engine import Engine
from cdb_engine.events import TokenEvent
from cdb_engine.setup import torch_dtype
from cdb_model.loader import DEFAULT_MODEL, load_model
from cdb_scheduler.request import FinishReason
from services import heap

QUICK = {"seconds": 2.0, "rounds": 1, "light_requests": 40, "capacity_requests": 96}
SAMPLE_S = 0.05  # the engine's queue counters read this often
UNBOUNDED = 10**6  # requests the engine may hold


class ClassConnection(InProcessConnection):
    """``cdb bench serve``'s in-process connection, request ``i`` at priority ``priorities[i]``."""

    def __init__(self, engine: Engine, priorities: Sequence[int]) -> None:
        super().__init__(engine)
        self.priorities = priorities

    async def stream(self, req: ServeRequest) -> AsyncIterator[int]:
        params = RequestParams(max_tokens=req.max_tokens, ignore_eos=True, priority=self.priorities[req.index])
        ids = self.engine.validate(req.prompt_arg(), params)
        async with self.engine.open_stream(ids, params) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    yield ev.depth
                elif ev.finish_reason is not FinishReason.LENGTH:
                    raise RuntimeError(f"finished with {ev.finish_reason}: {ev.error or ''}")


def run(engine: Engine, reqs: Sequence[ServeRequest], priorities: Sequence[int], cap: int | None = None) -> Run:
    """``reqs`` open-loop (at most ``cap`` in flight): their records and the (t, waiting, running) samples. The heap
    is settled first, as a serving process settles it once started: no collection rescans earlier runs' records."""
    heap.settle()
    conn = ClassConnection(engine, priorities)
    return asyncio.run(drive(conn, reqs, sample_interval=SAMPLE_S, max_concurrency=cap))


def classes(n: int, share: float, seed: int) -> list[int]:
    """Each request's class: 0 (top) with probability ``share``, else 1."""
    rng = random.Random(seed)
    return [0 if rng.random() < share else 1 for _ in range(n)]


def request_set(engine: Engine, n: int, seed: int) -> RequestSet:
    """``n`` Alpaca-like requests (live depths, Poisson arrivals), as ``cdb bench serve`` draws them."""
    lim, fit = engine.limits, DATASETS["alpaca"]
    limits = {"max_input": lim.max_input_tokens, "max_total": lim.max_total_tokens}
    vocab = engine.model_config.vocab_size
    return make_requests(
        fit, n, vocab=vocab, scale=1.0, depth=None, arrival=Arrival.POISSON, cv=1.0, seed=seed, **limits
    )


def capacity(engine: Engine, args: argparse.Namespace) -> float:
    """Completed requests/s of a closed loop at full width (a few more in flight to refill freed rows at once)."""
    reqs = [replace(r, arrival_s=0.0) for r in request_set(engine, args.capacity_requests, args.seed - 1).requests]
    records, _ = run(engine, reqs, [0] * len(reqs), concurrency(args.max_num_seqs))
    ends = sorted(r.finished_s for r in records if r.finished_s is not None)
    steady = ends[args.max_num_seqs : len(ends) - args.max_num_seqs]
    if len(steady) < 2 or steady[-1] <= steady[0]:
        raise SystemExit("capacity: too few requests for a steady part; raise --capacity-requests")
    return (len(steady) - 1) / (steady[-1] - steady[0])


def overload_requests(engine: Engine, rate: float, args: argparse.Namespace, seed: int) -> list[ServeRequest]:
    """Enough requests at ``rate`` to cover the window, those arriving within it."""
    expected = rate * args.seconds
    n = math.ceil(expected + 5 * math.sqrt(expected)) + 10
    return [r for r in request_set(engine, n, seed).at(rate) if r.arrival_s < args.seconds]


def one_round(engines: dict[str, Engine], k: int, cap: float, args: argparse.Namespace) -> Round:
    """Round ``k``: the light load and every policy on the round's requests, in rotated order."""
    seed = args.seed + 1000 * k
    plain = engines["priority"]
    light = request_set(plain, args.light_requests, seed).at(args.light * cap)
    heavy = overload_requests(plain, args.overload * cap, args, seed)
    labels = classes(max(len(light), len(heavy)), args.top_share, seed + 2)
    order = ("light", *POLICIES)
    runs: dict[str, Run] = {}
    for name in order[k % len(order) :] + order[: k % len(order)]:
        if name == "light":
            runs[name] = run(plain, light, labels)
        else:
            runs[name] = run(engines[name], heavy, [0] * len(labels) if name == "fifo" else labels)
    return Round(labels, runs)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    model_name = args.model or (FAMILIES["ouro"][0] if args.synthetic else DEFAULT_MODEL)
    cost = scaled_cost("ouro", args.op_us) if args.synthetic else ""
    base = EngineConfig(
        model=model_name, synthetic_cost=cost, max_num_seqs=args.max_num_seqs, speculative=Speculative.OFF
    )
    weights = None if cost else load_model(model_name, dtype=torch_dtype(base.dtype), device=base.device)
    configs = {"priority": base, "priority_depth": replace(base, priority_depth=args.floor)}
    with contextlib.ExitStack() as stack:
        engines: dict[str, Engine] = {}
        for name, cfg in configs.items():  # (the waiting queue unbounded: overload shows as latency, not refusal)
            target = stack.enter_context(open_target("in-process", cfg, model=weights, max_live=UNBOUNDED))
            assert isinstance(target, InProcessTarget)
            engines[name] = target.engine
        engines["fifo"] = engines["priority"]  # (the same engine: every request at priority 0)
        for eng in {id(e): e for e in engines.values()}.values():  # warm-up: first calls, the ops' first shapes
            run(eng, warmup_requests(request_set(eng, 8, args.seed), 8), [0] * 8)
        cap = capacity(engines["priority"], args)
        rounds: list[Round] = []
        for k in outputs.progress(range(args.rounds), args.rounds, "priority", enabled=not args.no_progress):
            rounds.append(one_round(engines, k, cap, args))
    return {
        "bench": "priority",
        "model": model_name,
        "synthetic_cost": cost,
        "max_num_seqs": args.max_num_seqs,
        "floor": args.floor,
        "top_share": args.top_share,
        "overload": args.overload,
        "light": args.light,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "light_requests": args.light_requests,
        "seed": args.seed,
        "native_scheduler": cdb_scheduler.NATIVE,
        "capacity_rps": cap,
    } | summarize(rounds, args.seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cdb bench priority", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--model", help=f"default {FAMILIES['ouro'][0]} (synthetic), {DEFAULT_MODEL} with --no-synthetic")
    p.add_argument("--no-synthetic", dest="synthetic", action="store_false", help="the model itself, not synthetic")
    p.add_argument("--op-us", type=float, default=500.0, help="synthetic stages: a loop op's modelled time (µs)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="width of the loop batch")
    p.add_argument("--floor", type=float, default=0.2, help="priority_depth's threshold Q (Ouro: lower is shallower)")
    p.add_argument("--top-share", type=float, default=0.2, help="share of requests in the top class (priority 0)")
    p.add_argument("--overload", type=float, default=2.0, help="the window's arrival rate over capacity")
    p.add_argument("--light", type=float, default=0.25, help="the light load's arrival rate over capacity")
    p.add_argument("--seconds", type=float, default=8.0, help="the overload window (arrivals; then drained)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (light load and the three policies)")
    p.add_argument("--light-requests", type=int, default=60, help="requests of each round's light load")
    p.add_argument("--capacity-requests", type=int, default=192, help="requests of the closed loop measuring capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 s window, 1 round, fewer requests")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", type=Path, help="write the JSON here")
    p.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parse_with_quick(p, argv, QUICK, {})
    if args.rounds < 1 or args.seconds <= 0 or args.light_requests < 2 or not 0 < args.top_share < 1:
        p.error("need --rounds >= 1, --seconds > 0, --light-requests >= 2 and 0 < --top-share < 1")
    if args.overload <= 0 or args.light <= 0 or args.capacity_requests <= 2 * args.max_num_seqs + 1:
        p.error("need --overload > 0, --light > 0 and --capacity-requests > 2 x --max-num-seqs + 1")
    return outputs.deliver(bench(args), args, table, plot)


if __name__ == "__main__":
    raise SystemExit(main())
