"""The soak's replicas: one process tree each on a fixed address, with a probe client, the pids it ever had, and
what it held right after start; and what each still holds once idle (counters, fds, ``/dev/shm`` segments)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from cdb_bench.processes import free_port, start_trees
from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from clients.sync_client import Client
from services.launcher import ServeHandle
from services.launcher.supervisor import Process

HELD = ("waiting", "running", "held_rows", "used_kv_blocks")
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

    def roles(self) -> dict[str, Process]:
        procs: dict[str, Process] = {s.role: p for s, p in self.tree.stages.items()}
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

    def serving(self, stage: Stage) -> Process | None:
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
    config: EngineConfig, host: str, first_port: int, n: int, env: Mapping[str, str]
) -> tuple[list[ServeHandle], list[BaseException]]:
    """Start ``n`` trees at once, each listening on a fixed port (a killed scheduler comes back at its address;
    one on port 0 would not be restarted): ``first_port`` and the following ones, or free ports if 0."""
    ports = [first_port + i if first_port else free_port(host) for i in range(n)]
    return start_trees(config, [f"{host}:{port}" for port in ports], env)


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


@dataclass(frozen=True, slots=True)
class Idle:
    """What each replica (by index) holds once the traffic ended and it went idle."""

    held: dict[int, dict[str, int]]  # counters still held (``HELD``), or how it could not be asked
    fd_growth: dict[int, dict[str, int]]  # role -> open fds beyond its count right after start
    segments: dict[int, tuple[int, int]]  # segments of its live processes: at start, now
    dead_segments: dict[int, int]  # segments of its dead processes not swept
    counters: dict[int, dict[str, int] | None]  # its scheduler's counters since it last started

    @classmethod
    def of(cls, replicas: list[Replica]) -> Idle:
        """Wait for every replica to go idle (``wait_idle``), then read what it holds."""
        held = {r.index: wait_idle(r) for r in replicas}
        fds = {r.index: fd_growth(r) for r in replicas}
        segments = {r.index: (r.base_segments, r.live_segments()) for r in replicas}
        dead = {r.index: r.dead_segments() for r in replicas}
        return cls(held, fds, segments, dead, {r.index: r.counters() for r in replicas})

    def leaks(self, replicas: list[Replica]) -> tuple[int, dict[str, Any]]:
        """Once the trees stopped: everything leaked (goal 0), and the detail by kind."""
        after_stop = sum(n for pid, n in segment_owners().items() if any(pid in r.pids for r in replicas))
        over = {i: {r: g for r, g in f.items() if g > FD_TOLERANCE} for i, f in self.fd_growth.items()}
        detail: dict[str, Any] = {
            "counters": {i: h for i, h in self.held.items() if h},
            "fds_over_tolerance": over,
            "segments_of_live_processes": {i: max(0, now - base) for i, (base, now) in self.segments.items()},
            "segments_of_dead_processes": self.dead_segments,
            "segments_after_stop": after_stop,
        }
        leaked = (
            sum(sum(h.values()) for h in self.held.values())
            + sum(g for f in detail["fds_over_tolerance"].values() for g in f.values())
            + sum(detail["segments_of_live_processes"].values())
            + sum(self.dead_segments.values())
            + after_stop
        )
        return leaked, detail
