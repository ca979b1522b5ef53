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

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
from tqdm import tqdm

from cdb_bench import outputs
from cdb_engine.config import DType, EngineConfig, RequestParams
from cdb_engine.engine import Engine
from cdb_scheduler.plan import SamplingParams, Stage
from clients.async_client import AsyncClient
from clients.common import GenerateOptions, StreamFinish, StreamToken
from clients.sync_client import Client
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
KINDS = ("stage_kill", "stage_freeze", "scheduler_kill")
SERVED_DTYPE = DType.FLOAT32  # what ``cdb serve`` computes in on a CPU (EngineConfig's auto dtype)
RECOVERY_LIMIT_S = 120.0  # a fault not healed by then is reported unrecovered
# A replica that serves again takes no fault for this long: a tick that waited for it would otherwise hit it the
# instant it is back, before the clients send it work (a frozen stage holding no op is found by the keepalive,
# ~2 s, not by the watchdog that a stage frozen mid-op meets, ~0.2 s).
SETTLE_S = 1.0
# Health SERVING throughout this long after Info counted the loss: the outage was shorter than the scheduler's
# readiness tick (CDB_HEALTH_INTERVAL_S, 0.1 s here), which would have shown a longer one as NOT_SERVING.
QUIET_S = 0.5
LATE_S = 0.05  # a fault this much after its tick waited for a replica (a claim and an Info call take less)
# Open fds a live process may hold beyond its role's count right after start without being called a leak: gRPC
# opens and closes a socket per connection (the soak's probe clients reconnect after a scheduler restart; a
# stage sees a restarted scheduler's fresh channel before the old one's close is processed) and the event engine
# keeps a few wakeup fds (eventfd / epoll) it creates lazily. A leak grows with the faults or the requests (one
# segment or socket per recovery or per request): dozens over a soak, not a handful.
FD_TOLERANCE = 4
SEGMENT = re.compile(r"cdb-(?P<kind>[a-z]+)-(?P<pid>\d+)-(?P<ns>\d+)-[0-9a-f]+")
SHM_DIR = "/dev/shm"
# Channels that notice a restarted scheduler soon: gRPC's default reconnect backoff grows to minutes, which would
# add seconds to every measured recovery and keep a restarted replica out of the rotation.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)
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
}


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


# --- the replicas -----------------------------------------------------------------------------------------------


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # it exited meanwhile
        return None


def segment_owners(shm_dir: str = SHM_DIR) -> dict[int, int]:
    """pid -> number of ``cdb-`` segments named after it in ``shm_dir`` (this pid namespace's trees)."""
    owners: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(shm_dir):
            m = SEGMENT.fullmatch(name)
            if m is not None:
                owners[int(m["pid"])] = owners.get(int(m["pid"]), 0) + 1
    return owners


@dataclass(eq=False)
class Replica:
    """One tree, its fixed address, a probe client (health, Info) and what it held right after start."""

    index: int
    tree: ServeHandle
    probe: Client
    busy: bool = False  # a fault of it is still recovering (guarded by Faults.lock)
    free_at: float = 0.0  # time.monotonic() from which it may take the next fault (guarded by Faults.lock)
    pids: set[int] = field(default_factory=set)  # every process of the tree seen, dead ones included
    base_fds: dict[str, int] = field(default_factory=dict)  # role ("scheduler" or a stage) -> open fds at start
    base_segments: int = 0  # /dev/shm segments of its processes at start

    @property
    def address(self) -> str:
        return self.tree.address

    def roles(self) -> dict[str, subprocess.Popen[bytes]]:
        procs: dict[str, subprocess.Popen[bytes]] = {s.role: p for s, p in self.tree.stages.items()}
        if self.tree.scheduler is not None:
            procs["scheduler"] = self.tree.scheduler
        return procs

    def note_pids(self) -> None:
        self.pids.update(p.pid for p in self.tree.processes())

    def fds(self) -> dict[str, int | None]:
        return {role: fd_count(p.pid) for role, p in self.roles().items()}

    def live_pids(self) -> set[int]:
        return {p.pid for p in self.tree.processes() if p.poll() is None}

    def live_segments(self) -> int:
        live = self.live_pids()
        return sum(n for pid, n in segment_owners().items() if pid in live)

    def dead_segments(self) -> int:
        """Segments named after a process of this tree that is gone (a restarted scheduler sweeps them)."""
        live = self.live_pids()
        return sum(n for pid, n in segment_owners().items() if pid in self.pids and pid not in live)

    def counters(self) -> dict[str, int] | None:
        """Its scheduler's counters since it (re)started: loop steps, stage losses, requests recomputed."""
        try:
            c = self.probe.info(timeout=2.0).counters
        except grpc.RpcError:
            return None
        return {k: int(c.get(k, 0)) for k in ("loop_steps", "recoveries", "recomputed")}

    def serving(self, stage: Stage) -> subprocess.Popen[bytes] | None:
        """The process serving ``stage`` now: with warm standby stages (``CDB_STANDBY_STAGES``) the one its
        scheduler attached (``Info.stage_pids``), not the idle one; else the role's only process."""
        procs = [p for p in (self.tree.stages.get(stage), self.tree.standbys.get(stage)) if p is not None]
        if len(procs) > 1:
            try:
                pid = self.probe.info(timeout=2.0).stage_pids.get(stage.role)
            except grpc.RpcError:
                return None
            procs = [p for p in procs if p.pid == pid]
        return procs[0] if procs else None

    def healed(self) -> list[float]:
        """Its scheduler's healed stage losses, loss -> re-attached, in seconds (``Info.recovery_seconds``)."""
        try:
            return list(self.probe.info(timeout=2.0).recovery_seconds)
        except grpc.RpcError:
            return []

    def recoveries(self) -> int | None:
        """Stage losses since its scheduler started (``Info.counters.recoveries``, counted when a loss is declared
        and its requests requeued, not once the stages are back); None when it cannot be asked."""
        counters = self.counters()
        return None if counters is None else counters["recoveries"]


def start_replicas(
    config: EngineConfig, host: str, first_port: int, n: int, env: dict[str, str]
) -> tuple[list[ServeHandle], list[BaseException]]:
    """Start ``n`` trees at once, each listening on a fixed port (a killed scheduler comes back at its address;
    one on port 0 would not be restarted): ``first_port`` and the following ones, or free ports if 0."""
    ports = [first_port + i if first_port else free_port(host) for i in range(n)]
    trees: list[ServeHandle | None] = [None] * n
    errors: list[BaseException] = []

    def start(i: int) -> None:
        try:
            trees[i] = serve_all(config, f"{host}:{ports[i]}", env=env)
        except BaseException as exc:  # reported by the caller once every start has ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,), name=f"soak-start-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [t for t in trees if t is not None], errors


def stop_replicas(trees: Sequence[ServeHandle], drain_timeout: float) -> None:
    threads = [threading.Thread(target=t.stop, kwargs={"drain_timeout": drain_timeout}) for t in trees]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# --- the faults -------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Fault:
    kind: str  # one of KINDS
    replica: int
    target: str  # the stage role, or "scheduler"
    pid: int
    at: float  # time.monotonic() of the signal
    waited_s: float = 0.0  # how late it was: every replica was still recovering at its tick
    recoveries_before: int | None = None
    detected_s: float | None = None  # health left SERVING
    recovery_s: float | None = None  # health SERVING again (after it left; or QUIET_S after Info counted the loss)
    killed: bool | None = None  # freezes: the frozen process was killed (by the scheduler's watchdog)
    reattach_s: float | None = None  # stage faults: the scheduler's own loss -> re-attached (Info.recovery_seconds)
    healed_before: int = 0  # Info.recovery_seconds entries before the fault
    proc: subprocess.Popen[bytes] | None = None


class Faults:
    """The three fault injectors, a watcher per fault until its replica serves again, and a pid collector."""

    def __init__(self, replicas: list[Replica], periods: dict[str, float], cap: int, seed: int) -> None:
        self.replicas, self.periods, self.cap, self.rng = replicas, periods, cap, random.Random(seed)
        self.lock = threading.Lock()
        self.faults: list[Fault] = []
        self.stop = threading.Event()  # no more faults
        self.t0 = 0.0
        self._injectors: list[threading.Thread] = []
        self._watchers: list[threading.Thread] = []
        self._pids_stop = threading.Event()
        self._pids = threading.Thread(target=self._collect_pids, name="soak-pids", daemon=True)

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._pids.start()
        for kind, period in self.periods.items():
            if period > 0:
                t = threading.Thread(target=self._inject_every, args=(kind, period), name=f"soak-{kind}", daemon=True)
                self._injectors.append(t)
                t.start()

    def finish(self) -> None:
        """No more faults (once each kind asked for fired); wait for every fault's recovery (at most
        RECOVERY_LIMIT_S each); resume a frozen process nobody killed (counted: ``killed`` False)."""
        self.stop.set()
        for t in self._injectors:
            t.join()
        for t in self._watchers:
            t.join(timeout=RECOVERY_LIMIT_S + 10)
        for f in self.faults:
            if f.kind == "stage_freeze" and f.proc is not None:
                f.killed = f.proc.poll() is not None
                if not f.killed:
                    f.proc.send_signal(signal.SIGCONT)
        self._pids_stop.set()
        self._pids.join()

    def _collect_pids(self) -> None:
        while not self._pids_stop.wait(0.25):  # a sampling period: restarted processes live for seconds at least
            for r in self.replicas:
                r.note_pids()

    def _inject_every(self, kind: str, period: float) -> None:
        """A fault of ``kind`` every ``period`` s until stopped, at most ``cap`` of them (0: no cap); the first one
        fires even when the traffic ended before its tick, so that every kind asked for is exercised. A fault that
        had to wait for a free replica is late (``waited_s``); the next one is ``period`` after it: ticks missed
        meanwhile are not made up."""
        next_at, fired = self.t0 + period, 0
        while not (self.cap and fired >= self.cap):
            stopped = self.stop.wait(max(0.0, next_at - time.monotonic()))  # the schedule, not a synchronisation
            if stopped and fired:
                return
            replica = self._claim(must=not fired)
            if replica is None:
                return
            late = time.monotonic() - next_at
            fault = self._inject(kind, replica, waited_s=late if late > LATE_S else 0.0)
            if fault is None:
                time.sleep(0.1)  # its process was between a death and its restart: try again
                continue
            fired += 1
            next_at = (fault.at if fault.waited_s else next_at) + period

    def _claim(self, must: bool) -> Replica | None:
        """A random replica with no fault still recovering, marked busy; waits for one; None once stopped (unless
        ``must``: a watcher frees its replica within RECOVERY_LIMIT_S)."""
        while must or not self.stop.is_set():
            with self.lock:
                now = time.monotonic()
                free = [r for r in self.replicas if not r.busy and now >= r.free_at]
                if free:
                    replica = self.rng.choice(free)
                    replica.busy = True
                    return replica
            time.sleep(0.05)  # polling for a replica back in service
        return None

    def _inject(self, kind: str, replica: Replica, waited_s: float) -> Fault | None:
        """Signal a random process of ``replica`` (claimed: busy) as ``kind`` says and watch its recovery; None
        (the replica released) when that process is between a death and its restart."""
        with self.lock:
            stage = self.rng.choice(list(Stage))
        target = "scheduler" if kind == "scheduler_kill" else stage.role
        proc = replica.tree.scheduler if kind == "scheduler_kill" else replica.serving(stage)
        if proc is None or proc.poll() is not None:  # between a death and its restart: skip this tick
            with self.lock:
                replica.busy = False
            return None
        before = None if kind == "scheduler_kill" else replica.recoveries()  # a restarted scheduler counts from 0
        replica.pids.add(proc.pid)
        fault = Fault(kind, replica.index, target, proc.pid, time.monotonic(), waited_s, before, proc=proc)
        if kind != "scheduler_kill":
            fault.healed_before = len(replica.healed())
        # Popen.send_signal does nothing once the process was reaped, so a recycled pid is never hit.
        proc.send_signal(signal.SIGSTOP if kind == "stage_freeze" else signal.SIGKILL)
        fault.at = time.monotonic()
        with self.lock:
            self.faults.append(fault)
        watcher = threading.Thread(target=self._watch, args=(fault, replica), name="soak-watch", daemon=True)
        self._watchers.append(watcher)
        watcher.start()
        return fault

    def _watch(self, fault: Fault, replica: Replica) -> None:
        """Poll the replica's health until it serves again after the fault: it left SERVING and came back. An
        outage shorter than the scheduler's readiness tick (a warm standby stage takes over in ~0.1 s) may never
        show in its health: then the loss that ``Info`` counts (``recoveries`` grows when the loss is declared,
        not when it is healed) followed by ``QUIET_S`` of SERVING with no dip is a recovery at the count."""
        try:
            last_info, counted_at = 0.0, None
            while time.monotonic() - fault.at < RECOVERY_LIMIT_S:
                status = replica.probe.health(timeout=1.0)
                now = time.monotonic()
                if status != "SERVING":
                    if fault.detected_s is None:
                        fault.detected_s = now - fault.at
                elif fault.detected_s is not None:
                    fault.recovery_s = now - fault.at
                    return
                elif counted_at is not None:
                    if now - counted_at >= QUIET_S:
                        fault.recovery_s = counted_at - fault.at
                        return
                elif fault.recoveries_before is not None and now - last_info > 0.25:
                    last_info = now
                    after = replica.recoveries()
                    if after is not None and after > fault.recoveries_before:
                        counted_at = now
                time.sleep(0.02)  # the health polling period
        finally:
            if fault.kind != "scheduler_kill" and fault.recovery_s is not None:
                healed = replica.healed()
                if len(healed) > fault.healed_before:
                    fault.reattach_s = healed[fault.healed_before]
            with self.lock:
                replica.busy, replica.free_at = False, time.monotonic() + SETTLE_S


# --- the traffic ------------------------------------------------------------------------------------------------


async def _one(
    client: AsyncClient, p: Planned, out: Outcome, gate: asyncio.Semaphore, bar: tqdm, resume_attempts: int
) -> None:
    async with gate:
        out.start = time.monotonic()
        timeout = p.deadline_s if p.fate == "deadline" else 600.0
        stream = cast(
            AsyncGenerator[StreamToken | StreamFinish, None],  # an async generator: it has aclose
            client.stream(p.prompt, timeout=timeout, resume_attempts=resume_attempts, **p.options()),
        )
        try:
            async with contextlib.aclosing(stream) as items:  # leaving early cancels the call at once
                async for item in items:
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
        except Exception as exc:  # counted as lost, never a crashed soak
            out.status = type(exc).__name__
        out.end = time.monotonic()
        bar.update(1)


async def drive(addresses: list[str], planned: list[Planned], concurrency: int, resume_attempts: int) -> list[Outcome]:
    outs = [Outcome() for _ in planned]
    client = AsyncClient(addresses, timeout=600, options=CHANNEL_OPTIONS)
    gate = asyncio.Semaphore(concurrency)
    with tqdm(total=len(planned), desc="soak", unit="req", file=sys.stderr) as bar:
        await asyncio.gather(*(_one(client, p, o, gate, bar, resume_attempts) for p, o in zip(planned, outs)))
    await client.close()
    return outs


# --- the figures ------------------------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _spread(values: list[float]) -> dict[str, float | None]:
    return {"p50": _percentile(values, 0.5), "p99": _percentile(values, 0.99), "max": max(values) if values else None}


def judge(
    planned: list[Planned], outs: list[Outcome], want: list[list[tuple[int, int]]]
) -> tuple[list[dict[str, Any]], list[int]]:
    """(lost, mismatched): requests that ended other than as drawn, and indexes of those whose tokens differ
    from ``want``."""
    lost: list[dict[str, Any]] = []
    mismatched: list[int] = []
    for p, o, w in zip(planned, outs, want):
        ok_status = o.status == p.fate or (p.fate == "cancel" and o.status == "complete" and len(o.tokens) == len(w))
        if p.fate == "deadline" and o.status == "complete":
            ok_status = True  # it beat its deadline
        if not ok_status:
            lost.append({"index": p.index, "fate": p.fate, "status": o.status, "tokens": len(o.tokens)})
        expected = w if o.status == "complete" else w[: len(o.tokens)]
        if o.tokens != expected:
            mismatched.append(p.index)
    return lost, mismatched


def summarize(
    planned: list[Planned],
    outs: list[Outcome],
    refs: dict[str, list[list[tuple[int, int]]]],
    tree_dtype: str,
    faults: list[Fault],
    t0: float,
) -> dict[str, Any]:
    fault_times = [f.at for f in faults]
    touched = {p.index for p, o in zip(planned, outs) if any(o.start <= t <= (o.end or t) for t in fault_times)}
    lost, mismatched = judge(planned, outs, refs[tree_dtype])
    against: dict[str, Any] = {}
    for dtype, want in refs.items():
        _, differ = judge(planned, outs, want)
        against[dtype] = {
            "mismatched": len(differ),
            "mismatched_in_flight_at_a_fault": sum(i in touched for i in differ),
            "mismatched_untouched": sum(i not in touched for i in differ),
            "examples": differ[:10],
        }
    gaps: dict[int, float] = {}
    gap_at: dict[int, float] = {}  # when the longest gap ended
    for p, o in zip(planned, outs):
        if o.times:
            stamps = [o.start, *o.times]
            gaps[p.index], gap_at[p.index] = max((b - a, b) for a, b in itertools.pairwise(stamps))
    slowest = [
        {
            "index": i,
            "fate": planned[i].fate,
            "status": outs[i].status,
            "tokens": len(outs[i].tokens),
            "start_s": outs[i].start - t0,
            "end_s": outs[i].end - t0,
            "longest_gap_s": gaps[i],
            "gap_ended_s": gap_at[i] - t0,
        }
        for i in sorted(gaps, key=gaps.__getitem__, reverse=True)[:5]
    ]
    calm = [g for i, g in gaps.items() if i not in touched]
    base = statistics.median(calm) if calm else 0.0
    added = [max(0.0, gaps[i] - base) for i in touched if i in gaps]
    by_kind: dict[str, Any] = {}
    for kind in KINDS:
        mine = [f for f in faults if f.kind == kind]
        times = [f.recovery_s for f in mine if f.recovery_s is not None]
        entry: dict[str, Any] = {
            "count": len(mine),
            "recovery_s": _spread(times),
            "reattach_s": _spread([f.reattach_s for f in mine if f.reattach_s is not None]),
            "unrecovered": len(mine) - len(times),
            "late": sum(f.waited_s > 0 for f in mine),  # every replica was still recovering at its tick
            "waited_s": sum(f.waited_s for f in mine),
            "by_target": {t: sum(f.target == t for f in mine) for t in sorted({f.target for f in mine})},
        }
        if kind == "stage_freeze":
            entry["detection_s"] = _spread([f.detected_s for f in mine if f.detected_s is not None])
            entry["not_killed"] = sum(f.killed is False for f in mine)
        by_kind[kind] = entry
    return {
        "requests": len(planned),
        "fates": {f: sum(p.fate == f for p in planned) for f in ("complete", "cancel", "deadline")},
        "statuses": {s: sum(o.status == s for o in outs) for s in sorted({o.status for o in outs})},
        "faults": by_kind,
        "fault_log": [
            {
                "kind": f.kind,
                "replica": f.replica,
                "target": f.target,
                "at_s": f.at - t0,
                "waited_s": f.waited_s,
                "detected_s": f.detected_s,
                "recovery_s": f.recovery_s,
                "reattach_s": f.reattach_s,
                **({"killed": f.killed} if f.kind == "stage_freeze" else {}),
            }
            for f in faults
        ],
        "unrecovered_faults": sum(f.recovery_s is None for f in faults) + sum(f.killed is False for f in faults),
        "lost": len(lost),
        "lost_examples": lost[:10],
        "tree_dtype": tree_dtype,
        "mismatched": len(mismatched),
        "mismatched_examples": mismatched[:10],
        "mismatched_float64_reference": against[DType.FLOAT64.value]["mismatched"],
        "mismatched_served_dtype_reference": against[SERVED_DTYPE.value]["mismatched"],
        "against_reference": against,
        "references_differ": sum(a != b for a, b in zip(refs[DType.FLOAT64.value], refs[SERVED_DTYPE.value])),
        "recovered_requests": len(touched),
        "added_latency_s": {"p50": _percentile(added, 0.5), "p99": _percentile(added, 0.99), "baseline_gap_s": base},
        "slowest_requests": slowest,
    }


def served_dtype_verdict(summary: dict[str, Any]) -> tuple[bool | None, str]:
    """Whether recomputation was exact in the served dtype, and the line that says so."""
    served = summary["against_reference"][SERVED_DTYPE.value]
    n, differ = summary["recovered_requests"], served["mismatched_in_flight_at_a_fault"]
    refs = f"the float32 and float64 fault-free runs differ on {summary['references_differ']} requests"
    if summary["tree_dtype"] != SERVED_DTYPE.value:
        return None, (
            f"recomputation in {SERVED_DTYPE} (served dtype): not tested, the tree ran {summary['tree_dtype']} "
            f"(--dtype {SERVED_DTYPE} tests it); {refs}"
        )
    if served["mismatched_untouched"]:
        return False, (
            f"recomputation in {SERVED_DTYPE} (served dtype): cannot be exact, {served['mismatched_untouched']} "
            f"requests no fault touched already differ from the {SERVED_DTYPE} fault-free run (batching changes "
            f"tokens); {differ} of {n} recovered requests differ; {refs}"
        )
    exact = differ == 0
    return exact, (
        f"recomputation in {SERVED_DTYPE} (served dtype): {'exact' if exact else 'NOT exact'}, {differ} of {n} "
        f"requests in flight at a fault differ from the {SERVED_DTYPE} fault-free run; {refs}"
    )


# --- idle checks ------------------------------------------------------------------------------------------------


def wait_idle(replica: Replica, limit_s: float = 60.0) -> dict[str, int]:
    """Wait until the replica serves and holds nothing (at most ``limit_s``); what it still holds."""
    with contextlib.suppress(TimeoutError):
        replica.probe.wait_for_status("SERVING", timeout=limit_s)
    deadline = time.monotonic() + limit_s
    while True:
        try:
            counters = replica.probe.info(timeout=5.0).counters
            held = {k: counters[k] for k in HELD if counters[k]}
        except grpc.RpcError as exc:
            held = {"unreachable": 1, f"info_{exc.code().name}": 1}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.1)  # the last aborts are ordered on the engine thread


def fd_growth(replica: Replica, settle_s: float = 5.0) -> dict[str, int]:
    """Open fds of each live process beyond its role's count right after start (those beyond FD_TOLERANCE are
    leaks); polled for ``settle_s`` while above, as closed connections are processed."""
    deadline = time.monotonic() + settle_s
    while True:
        now = replica.fds()
        growth = {r: n - replica.base_fds.get(r, n) for r, n in now.items() if n is not None}
        if all(g <= FD_TOLERANCE for g in growth.values()) or time.monotonic() > deadline:
            return growth
        time.sleep(0.2)  # a settling poll


# --- the command ------------------------------------------------------------------------------------------------


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _resolve(args)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 2 or args.replicas < 1:
        print(
            "cdb bench soak: --requests, --concurrency, --replicas must be >= 1 and --max-tokens >= 2", file=sys.stderr
        )
        return 2
    host, _, port = args.listen.rpartition(":")
    config = EngineConfig(
        model=args.model,
        dtype=DType(args.dtype),
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=1024,
        max_waiting=max(64, args.concurrency),
    )
    planned = plan(args.requests, args.seed, args.cancel, args.deadline, args.max_tokens)
    phases: dict[str, float] = {}
    mark = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "CDB_METRICS_ADDR"}  # replicas would share its port
    env.update(CDB_HEALTH_INTERVAL_S="0.1", CDB_STAGE_KEEPALIVE_S="2", CDB_HTTP_ADDR="")
    if args.standby_stages:
        env["CDB_STANDBY_STAGES"] = "true"
    # The trees start while the references are computed (both are mostly interpreter and torch start-up).
    started: list[tuple[list[ServeHandle], list[BaseException]]] = []

    def start() -> None:
        started.append(start_replicas(config, host, int(port), args.replicas, env))
        phases["replicas_started"] = time.monotonic() - mark

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    refs: dict[str, list[list[tuple[int, int]]]] = {}
    for dtype in (DType.FLOAT64, SERVED_DTYPE):
        print(f"cdb bench soak: {dtype} fault-free reference of {len(planned)} requests (in-process)", file=sys.stderr)
        refs[dtype.value] = reference(
            EngineConfig(
                model=args.model,
                dtype=dtype,
                max_num_seqs=args.max_num_seqs,
                num_kv_blocks=1024,
                max_waiting=max(64, args.concurrency),
            ),
            planned,
        )
        phases[f"{dtype}_reference_done"] = time.monotonic() - mark
    starter.join()
    trees, errors = started[0] if started else ([], [RuntimeError("the replicas did not start")])
    if errors:
        stop_replicas(trees, 0.0)
        raise errors[0]
    replicas = [Replica(i, t, Client(t.address, timeout=30, options=CHANNEL_OPTIONS)) for i, t in enumerate(trees)]
    try:
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
        faults = Faults(replicas, periods, args.faults_per_kind, args.seed)
        phases["traffic_started"] = time.monotonic() - mark
        faults.start()
        outs = asyncio.run(drive([r.address for r in replicas], planned, args.concurrency, args.resume_attempts))
        wall = time.monotonic() - faults.t0
        phases["traffic_done"] = time.monotonic() - mark
        faults.finish()
        phases["faults_recovered"] = time.monotonic() - mark
        held = {r.index: wait_idle(r) for r in replicas}
        fds = {r.index: fd_growth(r) for r in replicas}
        segments = {r.index: (r.base_segments, r.live_segments()) for r in replicas}
        dead_owned = {r.index: r.dead_segments() for r in replicas}
        healed = {r.index: r.counters() for r in replicas}
        phases["idle_checked"] = time.monotonic() - mark
    finally:
        for r in replicas:
            r.probe.close()
        stop_replicas(trees, 5.0)
        phases["stopped"] = time.monotonic() - mark
    owners = segment_owners()
    after_stop = sum(n for pid, n in owners.items() if any(pid in r.pids for r in replicas))
    summary = summarize(planned, outs, refs, config.dtype.value, faults.faults, faults.t0)
    exact, verdict = served_dtype_verdict(summary)
    leaks: dict[str, Any] = {
        "counters": {i: h for i, h in held.items() if h},
        "fds_over_tolerance": {i: {r: g for r, g in f.items() if g > FD_TOLERANCE} for i, f in fds.items()},
        "segments_of_live_processes": {i: max(0, now - base) for i, (base, now) in segments.items()},
        "segments_of_dead_processes": dead_owned,
        "segments_after_stop": after_stop,
    }
    leaked = (
        sum(sum(h.values()) for h in held.values())
        + sum(g for f in leaks["fds_over_tolerance"].values() for g in f.values())
        + sum(leaks["segments_of_live_processes"].values())
        + sum(dead_owned.values())
        + after_stop
    )
    summary.update(
        wall_s=wall,
        phases_s=phases,
        recomputation_exact_in_served_dtype=exact,
        served_dtype_verdict=verdict,
        leaked=leaked,
        leaked_detail=leaks,
        idle={
            "fd_growth": fds,
            "fd_tolerance": FD_TOLERANCE,
            "fds_at_start": {r.index: r.base_fds for r in replicas},
            "segments_at_start_and_idle": segments,
        },
        scheduler_counters_since_last_start=healed,
        config={
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
        },
    )
    summary["config"] = {
        k: (str(v) if not isinstance(v, int | float | bool | list | type(None)) else v)
        for k, v in summary["config"].items()
    }
    if args.out:
        outputs.write_json(args.out, "soak", summary)
        series = {
            kind: (
                [f["at_s"] for f in summary["fault_log"] if f["kind"] == kind and f["recovery_s"] is not None],
                [f["recovery_s"] for f in summary["fault_log"] if f["kind"] == kind and f["recovery_s"] is not None],
            )
            for kind in KINDS
        }
        series = {k: v for k, v in series.items() if v[0]}
        if series:
            title = f"fault -> SERVING again ({summary['requests']} requests, {args.replicas} replicas)"
            outputs.lines(args.out / "recovery.png", title, series, "seconds into the run", "recovery (s)")
    ok = summary["lost"] == summary["mismatched"] == summary["leaked"] == summary["unrecovered_faults"] == 0
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(report(summary))
    return 0 if ok else 1


def report(summary: dict[str, Any]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"requests {summary['requests']} {summary['fates']} over {summary['config']['replicas']} replicas "
        f"in {summary['wall_s']:.0f}s, tree dtype {summary['tree_dtype']}",
        f"lost {summary['lost']}  mismatched {summary['mismatched']} (float64 reference "
        f"{summary['mismatched_float64_reference']}, {SERVED_DTYPE} reference "
        f"{summary['mismatched_served_dtype_reference']})  leaked {summary['leaked']}  "
        f"unrecovered faults {summary['unrecovered_faults']}",
    ]
    for kind, f in summary["faults"].items():
        rec = f["recovery_s"]
        line = f"{kind}: {f['count']} {f['by_target']}  recovery s p50 {fmt(rec['p50'])} p99 {fmt(rec['p99'])}"
        line += f" max {fmt(rec['max'])}"
        if f["reattach_s"]["p50"] is not None:
            line += f"  re-attached s p50 {fmt(f['reattach_s']['p50'])} p99 {fmt(f['reattach_s']['p99'])}"
        if f["late"]:
            line += f"  late {f['late']} (waited {f['waited_s']:.0f}s for a replica back in service)"
        if "detection_s" in f:
            line += f"  detected s p50 {fmt(f['detection_s']['p50'])}"
        lines.append(line)
    add = summary["added_latency_s"]
    lines.append(
        f"added latency of {summary['recovered_requests']} requests in flight at a fault s: "
        f"p50 {fmt(add['p50'])} p99 {fmt(add['p99'])}"
    )
    lines.append(summary["served_dtype_verdict"])
    return "\n".join(lines)
