"""The soak's faults: three injectors (stage kill, stage freeze, scheduler kill), each on its own schedule, each
hitting a random replica that is serving, and a watcher per fault that times its replica's recovery."""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass

from cdb_bench.soak.replicas import Replica
from cdb_scheduler.plan import Stage
from services.launcher.supervisor import Process

KINDS = ("stage_kill", "stage_freeze", "scheduler_kill")
RECOVERY_LIMIT_S = 120.0  # a fault not healed by then is reported unrecovered
# A replica that serves again takes no fault for this long: a tick that waited for it would otherwise hit it the
# instant it is back, before the clients send it work (a frozen stage holding no op is found by the keepalive,
# ~2 s, not by the watchdog that a stage frozen mid-op meets, ~0.2 s).
SETTLE_S = 1.0
# Health SERVING throughout this long after Info counted the loss: the outage was shorter than the scheduler's
# readiness tick (CDB_HEALTH_INTERVAL_S, 0.1 s here), which would have shown a longer one as NOT_SERVING.
QUIET_S = 0.5
LATE_S = 0.05  # a fault this much after its tick waited for a replica (a claim and an Info call take less)


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
    proc: Process | None = None


class Faults:
    """The three fault injectors, a watcher per fault until its replica serves again, and a pid collector."""

    def __init__(
        self,
        replicas: list[Replica],
        periods: dict[str, float],
        cap: int,
        seed: int,
        first_after: dict[str, int] | None = None,
    ) -> None:
        self.replicas, self.periods, self.cap, self.rng = replicas, periods, cap, random.Random(seed)
        # kind -> the first fault of that kind fires once this many requests have started (``started``), so that it
        # meets requests in flight however fast the traffic runs; the kinds left out fire on their period
        self.first_after = first_after or {}
        self._started = 0
        self._progress = threading.Condition()
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
        with self._progress:
            self._progress.notify_all()
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

    def started(self) -> None:
        """A request of the traffic has started (called by the traffic, on any thread)."""
        with self._progress:
            self._started += 1
            self._progress.notify_all()

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
        if kind in self.first_after:  # the first one: by the traffic's progress, not by the clock
            with self._progress:
                self._progress.wait_for(lambda: self._started >= self.first_after[kind] or self.stop.is_set())
            next_at = time.monotonic()
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
