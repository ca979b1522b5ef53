"""``cdb bench soak``: many requests through a real process tree while a random stage is killed every few seconds.

    cdb bench soak --requests 10000 --kill-every 5 --out soak-out

Each request is drawn once from the seed: a prompt, an output length, greedy or seeded sampling, and a fate: run
to the end, be cancelled by the client after a few tokens, or carry a short deadline. A fault-free reference of
the same requests comes from an in-process engine (float64: batching never changes a token, so the reference is
exact). The tree's supervisor restarts each killed stage; the scheduler re-attaches it and recomputes the
requests it was running. Reported:

- ``lost``: requests that ended other than as drawn (an error status, or no finish) — goal 0;
- ``mismatched``: requests whose streamed tokens (id and served depth) differ from the reference's (the prefix
  for cancelled and deadline-cut ones) — goal 0;
- ``leaked``: waiting / running requests, bank rows and KV blocks still held once the tree is idle — goal 0;
- the recovery time of each kill (SIGKILL -> health SERVING again) and the added latency of recovered requests
  (in flight at a kill): their longest gap between tokens (or to the first token) minus the median gap of the
  requests no kill touched, p50 / p99.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from cdb_bench import outputs
from cdb_engine.config import DType, EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_scheduler.plan import SamplingParams, Stage
from clients.async_client import AsyncClient
from clients.common import GenerateOptions, StreamToken
from services.launcher import ServeHandle, serve_all

WORDS = tuple(
    [
        "the",
        "loop",
        "runs",
        "a",
        "shared",
        "block",
        "again",
        "and",
        "again",
        "until",
        "the",
        "token",
        "is",
        "easy",
        "enough",
        "to",
        "leave",
    ]
)
HELD = ("waiting", "running", "held_rows", "used_kv_blocks")


@dataclass(frozen=True, slots=True)
class Planned:
    """One request as drawn: what is sent, and how its client behaves."""

    index: int
    prompt: str
    max_tokens: int
    temperature: float
    seed: int
    fate: str  # "complete" | "cancel" | "deadline"
    cancel_after: int = 0  # tokens before the client cancels
    deadline_s: float = 0.0

    def options(self) -> GenerateOptions:
        opts = GenerateOptions(max_tokens=self.max_tokens, ignore_eos=True, request_id=f"soak-{self.index}")
        if self.temperature > 0:
            opts["temperature"], opts["top_p"], opts["seed"] = self.temperature, 0.95, self.seed
        return opts

    def params(self) -> RequestParams:
        sampling = SamplingParams(temperature=self.temperature, top_p=0.95 if self.temperature else 1.0, seed=self.seed)
        return RequestParams(max_tokens=self.max_tokens, sampling=sampling, ignore_eos=True)


@dataclass(slots=True)
class Outcome:
    tokens: list[tuple[int, int]] = field(default_factory=list)  # (id, depth)
    times: list[float] = field(default_factory=list)  # time.monotonic() of each token
    start: float = 0.0
    end: float = 0.0
    status: str = ""  # "complete" | "cancel" | "deadline" | an error name


def plan(n: int, seed: int, cancel: float, deadline: float, max_tokens: int) -> list[Planned]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.randint(2, 12)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        length = rng.randint(max(2, max_tokens // 6), max_tokens)
        temperature = 0.8 if rng.random() < 0.5 else 0.0
        draw = rng.random()
        if draw < cancel:
            out.append(Planned(i, prompt, length, temperature, i, "cancel", cancel_after=rng.randint(1, length)))
        elif draw < cancel + deadline:
            out.append(Planned(i, prompt, length, temperature, i, "deadline", deadline_s=rng.uniform(0.05, 1.0)))
        else:
            out.append(Planned(i, prompt, length, temperature, i, "complete"))
    return out


def reference(config: EngineConfig, planned: list[Planned]) -> list[list[tuple[int, int]]]:
    """The fault-free tokens of every request, from an in-process engine."""
    with Engine(config) as engine:
        done = engine.generate([p.prompt for p in planned], [p.params() for p in planned])
    return [list(zip(c.token_ids, c.depths)) for c in done]


async def _one(client: AsyncClient, p: Planned, out: Outcome, gate: asyncio.Semaphore, bar: tqdm) -> None:
    async with gate:
        out.start = time.monotonic()
        timeout = p.deadline_s if p.fate == "deadline" else 600.0
        try:
            async for item in client.stream(p.prompt, timeout=timeout, **p.options()):
                if isinstance(item, StreamToken):
                    out.tokens.append((item.id, item.depth))
                    out.times.append(time.monotonic())
                    if p.fate == "cancel" and len(out.tokens) >= p.cancel_after:
                        out.status = "cancel"
                        break
            out.status = out.status or "complete"
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            out.status = "deadline" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name
        out.end = time.monotonic()
        bar.update(1)


class Killer:
    """Kills a random stage every ``period`` seconds; records each kill and when health was SERVING again."""

    def __init__(self, tree: ServeHandle, period: float, seed: int) -> None:
        self.tree, self.period, self.rng = tree, period, random.Random(seed)
        self.kills: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self, health: Any) -> None:
        while not self.stop.wait(self.period):  # the kill schedule, not a synchronisation
            stage = self.rng.choice(list(Stage))
            proc = self.tree.stages[stage]
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            kill: dict[str, Any] = {"stage": stage.role, "at": t0, "recovery_s": None}
            self.kills.append(kill)
            seen_down = False
            while not self.stop.is_set():
                status = health()
                seen_down = seen_down or status != "SERVING"
                if seen_down and status == "SERVING":
                    kill["recovery_s"] = time.monotonic() - t0
                    break
                if time.monotonic() - t0 > 120:
                    break
                self.stop.wait(0.02)  # health polling period


async def drive(address: str, planned: list[Planned], concurrency: int) -> list[Outcome]:
    outs = [Outcome() for _ in planned]
    client = AsyncClient(address, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    with tqdm(total=len(planned), desc="soak", unit="req", file=sys.stderr) as bar:
        await asyncio.gather(*(_one(client, p, o, gate, bar) for p, o in zip(planned, outs)))
    await client.channel.close()
    return outs


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(
    planned: list[Planned], outs: list[Outcome], want: list[list[tuple[int, int]]], kills: list[dict[str, Any]]
) -> dict[str, Any]:
    lost, mismatched = [], []
    for p, o, w in zip(planned, outs, want):
        ok_status = o.status == p.fate or (p.fate == "cancel" and o.status == "complete" and len(o.tokens) == len(w))
        if p.fate == "deadline" and o.status == "complete":
            ok_status = True  # it beat its deadline
        if not ok_status:
            lost.append({"index": p.index, "fate": p.fate, "status": o.status})
        expected = w if o.status == "complete" else w[: len(o.tokens)]
        if o.tokens != expected:
            mismatched.append(p.index)
    kill_times = [k["at"] for k in kills]
    gaps: dict[int, float] = {}
    for p, o in zip(planned, outs):
        if o.times:
            stamps = [o.start, *o.times]
            gaps[p.index] = max(b - a for a, b in itertools.pairwise(stamps))
    touched = {p.index for p, o in zip(planned, outs) if any(o.start <= t <= (o.end or t) for t in kill_times)}
    calm = [g for i, g in gaps.items() if i not in touched]
    base = statistics.median(calm) if calm else 0.0
    added = [max(0.0, gaps[i] - base) for i in touched if i in gaps]
    recoveries = [k["recovery_s"] for k in kills if k["recovery_s"] is not None]
    return {
        "requests": len(planned),
        "fates": {f: sum(p.fate == f for p in planned) for f in ("complete", "cancel", "deadline")},
        "kills": len(kills),
        "kill_log": [{"stage": k["stage"], "recovery_s": k["recovery_s"]} for k in kills],
        "kills_by_stage": {s.role: sum(k["stage"] == s.role for k in kills) for s in Stage},
        "lost": len(lost),
        "lost_examples": lost[:10],
        "mismatched": len(mismatched),
        "mismatched_examples": mismatched[:10],
        "recovered_requests": len(touched),
        "recovery_s": {
            "p50": _percentile(recoveries, 0.5),
            "p99": _percentile(recoveries, 0.99),
            "max": max(recoveries) if recoveries else None,
            "unrecovered_kills": len(kills) - len(recoveries),
        },
        "added_latency_s": {"p50": _percentile(added, 0.5), "p99": _percentile(added, 0.99), "baseline_gap_s": base},
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdb bench soak", description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("--model", default="ouro-tiny", help="preset name or checkpoint folder")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--kill-every", type=float, default=5.0, help="seconds between stage kills (0: none)")
    p.add_argument("--concurrency", type=int, default=48, help="streams open at once")
    p.add_argument("--max-tokens", type=int, default=24, help="longest output (lengths are uniform below it)")
    p.add_argument("--cancel", type=float, default=0.05, help="fraction of requests the client cancels")
    p.add_argument("--deadline", type=float, default=0.05, help="fraction with a short deadline")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--out", type=Path, help="folder for soak.json")
    p.add_argument("--json", action="store_true", help="print the JSON summary instead of the table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 2:
        print("cdb bench soak: --requests, --concurrency must be >= 1 and --max-tokens >= 2", file=sys.stderr)
        return 2
    config = EngineConfig(
        model=args.model,
        dtype=DType.FLOAT64,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=1024,
        max_waiting=max(64, args.concurrency),
    )
    planned = plan(args.requests, args.seed, args.cancel, args.deadline, args.max_tokens)
    print(f"cdb bench soak: fault-free reference of {len(planned)} requests (in-process)", file=sys.stderr)
    want = reference(config, planned)
    env = {**os.environ, "CDB_HEALTH_INTERVAL_S": "0.1", "CDB_STAGE_KEEPALIVE_S": "2"}
    with serve_all(config, args.listen, env=env) as tree:
        killer = Killer(tree, args.kill_every, args.seed)
        from clients.sync_client import Client

        with Client(tree.address, timeout=30) as probe:
            watcher = threading.Thread(target=killer.run, args=(probe.health,), daemon=True)
            t0 = time.monotonic()
            if args.kill_every > 0:
                watcher.start()
            outs = asyncio.run(drive(tree.address, planned, args.concurrency))
            wall = time.monotonic() - t0
            killer.stop.set()
            if watcher.is_alive():
                watcher.join(timeout=130)
            probe.wait_for_status("SERVING", timeout=120)
            deadline = time.monotonic() + 60
            while True:
                counters = probe.info().counters
                leaked = {k: counters[k] for k in HELD if counters[k]}
                if not leaked or time.monotonic() > deadline:
                    break
                time.sleep(0.1)  # the last aborts are ordered on the engine thread
            healed = probe.info().counters.get("recoveries", 0)
    summary = summarize(planned, outs, want, killer.kills)
    summary.update(
        wall_s=wall,
        leaked=sum(leaked.values()),
        leaked_detail=leaked,
        recoveries_reported=healed,
        config={**asdict(config), "kill_every_s": args.kill_every, "concurrency": args.concurrency},
    )
    summary["config"] = {
        k: (str(v) if not isinstance(v, int | float | bool | type(None)) else v) for k, v in summary["config"].items()
    }
    if args.out:
        outputs.write_json(args.out, "soak", summary)
        log = [k for k in summary["kill_log"] if k["recovery_s"] is not None]
        if log:
            labels = [f"{i + 1} {k['stage'][0]}" for i, k in enumerate(log)]  # kill number, stage initial
            title = f"SIGKILL -> SERVING again, per kill ({summary['requests']} requests)"
            outputs.bars(args.out / "recovery.png", title, labels, [k["recovery_s"] for k in log], "seconds")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        rec, add = summary["recovery_s"], summary["added_latency_s"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"requests {summary['requests']}  kills {summary['kills']} {summary['kills_by_stage']}")
        print(f"lost {summary['lost']}  mismatched {summary['mismatched']}  leaked {summary['leaked']}")
        print(f"recovery s: p50 {fmt(rec['p50'])} p99 {fmt(rec['p99'])} max {fmt(rec['max'])}")
        print(
            f"added latency of {summary['recovered_requests']} recovered requests s: "
            f"p50 {fmt(add['p50'])} p99 {fmt(add['p99'])}"
        )
    return 0 if summary["lost"] == summary["mismatched"] == summary["leaked"] == 0 else 1
