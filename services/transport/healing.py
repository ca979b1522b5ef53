"""Healing of the stage plane: the outage state, the recovery thread that re-attaches the stages, and the hang
watchdog thread (the rule itself: ``services.transport.watchdog``).

When a stream breaks or ends (stage process killed, connection lost, keepalive timeout on a frozen stage) the
executor is in an *outage*: the fence board is aborted (stages waiting on a fence give up at once), every
outstanding op is void, the other streams are ended and ``poll`` returns a ``StageLoss`` (ops submitted before
that ``poll`` returns are dropped: the scheduler voids its in-flight state and recomputes its running requests,
``Scheduler.recover``). The recovery thread re-``Configure``s all three stages with fresh state over a new fence
board that starts at the last void ``seq`` of each stage, a lost stage on its role's warm standby first
(``StageSet.attach``), with a backoff doubling from ``CDB_RECONNECT_BACKOFF_S`` up to 0.5 s; ops submitted
meanwhile wait in a backlog and go out, in order, once every stage is back. If no complete set of stages is back
within ``CDB_STAGE_DOWN_LIMIT_S``, the executor gives up for good (``broken``): every outstanding op gets an error
result and every later ``submit`` is answered with one at once. ``outage`` / ``broken`` are what the service's
health check reads.

Hung stages: the watchdog thread checks every stage's oldest outstanding op against its budget (and, for a stage
process on this host, whether it is stopped). A hung stage is a loss like a death: the same ``StageLoss`` and
recovery, and its process is SIGKILLed so that its supervisor restarts it (a stage found stopped when the stages
are re-attached is killed too). Each batch carries a fence-wait limit of its own, twice the floor plus the
budgets of every op outstanding when it is sent: a wait on a hung stage's op is released by the loss well before.

The executor (``HealingHost``) keeps what its lock guards (which ops are void, the backlog, the links); these
threads ask it, through the calls of that protocol.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from cdb_scheduler.plan import Stage
from services.settings import Settings
from services.transport.fences import FenceBoard
from services.transport.links import LinkOwner, StageLink, close_rings, new_rings
from services.transport.stages import StageSet
from services.transport.watchdog import Hang, is_stopped, kill

_RECONNECT_BACKOFF_MAX_S = 0.5  # a restarted stage is re-attached within this of listening

log = logging.getLogger("cdb.executor")


@dataclass(slots=True)
class Outage:
    """Whether the stages are attached, being re-attached (``why``) or given up on (``broken``); the figures of
    the outages healed. The executor changes it under its lock."""

    why: str | None = None  # a stage is lost; re-attaching (None: all attached)
    broken: str | None = None  # gave up: no stages came back in time (permanent)
    epoch: int = 0  # bumped at every loss: replies of older links are void
    loss_pending: bool = False  # a StageLoss is queued and not yet polled: submits are pre-recovery, dropped
    lost: set[Stage] = field(default_factory=set)  # stages lost since the last re-attach
    lost_at: float = 0.0
    recovering: bool = False  # the recovery thread runs
    recoveries: int = 0  # outages healed
    takeovers: int = 0  # outages healed by another process of a role (a standby)
    recovery_s: list[float] = field(default_factory=list)  # loss -> every stage re-attached, per healed outage

    def lose(self, stage: Stage, why: str) -> bool:
        """``stage`` is lost (``why``); whether a recovery thread must start (none runs)."""
        self.epoch += 1
        if self.why is None:
            self.lost_at = time.monotonic()
        self.why = why
        self.lost.add(stage)
        self.loss_pending = True
        start, self.recovering = not self.recovering, True
        return start

    def healed(self, took_over: bool) -> None:
        """Every stage is attached again (``took_over``: some on another process of their role)."""
        self.why = None  # the recovery loop sees it and ends (or serves a newer loss)
        self.recoveries += 1
        self.takeovers += took_over
        self.lost.clear()
        self.recovery_s.append(time.monotonic() - self.lost_at)


@dataclass(frozen=True, slots=True)
class Reattach:
    """What the recovery thread is to do: re-attach the stages for ``epoch``, on a board that starts at
    ``completed`` (void ops count as done), ``lost`` stages on a standby first, before ``deadline``."""

    epoch: int
    completed: dict[Stage, int]
    lost: set[Stage]
    deadline: float  # time.monotonic()


class HealingHost(LinkOwner, Protocol):
    """What the healing threads ask of the executor (``GrpcExecutor``); each call takes its lock."""

    @property
    def outage(self) -> str | None: ...

    def reattach_plan(self) -> Reattach | None:
        """The outage to heal now; None when there is none left to heal (the recovery thread then ends)."""
        ...

    def install(self, epoch: int, board: FenceBoard, links: dict[Stage, StageLink], took_over: bool) -> bool:
        """Serve on ``board`` and ``links`` from now on if still in the outage of ``epoch``; whether it did."""
        ...

    def give_up(self, why: str) -> None:
        """No stages came back in time: fail every outstanding op, and every later one at once."""
        ...

    def hang(self, stopped: dict[Stage, bool]) -> tuple[int, Hang] | None:
        """The hang rule's verdict now (``stopped``: which local stage processes are stopped), with the epoch it
        was reached in; None when attached and nothing hangs (or while there is no session to watch)."""
        ...


class Healer:
    """The recovery thread (started at a loss) and the watchdog thread of one executor."""

    def __init__(self, host: HealingHost, stages: StageSet, settings: Settings, tick_s: float) -> None:
        self.host = host
        self.stages = stages
        self.settings = settings
        self.tick_s = tick_s
        self.closing = threading.Event()

    def start_watchdog(self) -> None:
        threading.Thread(target=self._watchdog, name="cdb-stage-watchdog", daemon=True).start()

    def start_recovery(self) -> None:
        threading.Thread(target=self._recover, name="cdb-stage-recovery", daemon=True).start()

    def close(self) -> None:
        """End both threads (at their next wait)."""
        self.closing.set()

    # --- recovery --------------------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Re-attach every stage (backoff) until done, closed, or past the down limit."""
        backoff = self.settings.reconnect_backoff_s
        while (plan := self.host.reattach_plan()) is not None:
            try:
                self._reattach(plan)
                continue  # installed (the loop ends) or a newer loss came meanwhile (the loop retries)
            except Exception as exc:  # a stage not back yet (connection refused, timeout, refused Configure)
                problem = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= plan.deadline:
                self.host.give_up(
                    f"{self.host.outage}; no complete set of stages back within "
                    f"{self.settings.stage_down_limit_s:g}s (last: {problem})"
                )
                return
            log.info("stages not back yet (%s); retrying in %.2fs", problem.splitlines()[0][:200], backoff)
            if self.closing.wait(min(backoff, max(0.0, plan.deadline - time.monotonic()))):
                continue  # closed: the loop ends
            backoff = min(backoff * 2, _RECONNECT_BACKOFF_MAX_S)

    def _reattach(self, plan: Reattach) -> None:
        stages = self.stages
        stages.renew_segments()
        stages.kill_stopped()
        board = FenceBoard.create(plan.completed)
        links: dict[Stage, StageLink] = {}
        rings = {}
        try:
            rings = new_rings(self.settings)
            moved: dict[Stage, str] = {}
            for stage in Stage:  # waits for the channel to be ready (a restarting stage), bounded
                timeout = max(1.0, min(10.0, plan.deadline - time.monotonic()))
                address = stages.attach(stage, stage in plan.lost, board, rings.get(stage), timeout)
                if address != stages.addrs[stage]:
                    moved[stage] = address
            stages.move(moved)
            for stage in Stage:
                links[stage] = stages.link(stage, self.host, plan.epoch, rings.pop(stage, None))
            installed = self.host.install(plan.epoch, board, links, bool(moved))
        except BaseException:
            for link in links.values():
                link.cancel()
            close_rings(rings)
            board.close()
            raise
        if not installed:  # a newer loss (or close) meanwhile: these links are stale
            for link in links.values():
                link.cancel()
            board.close()

    # --- the hang watchdog -----------------------------------------------------------------------------------

    def _watchdog(self) -> None:
        """Every ``tick_s``, ask the hang rule about each stage's oldest outstanding op."""
        while not self.closing.wait(self.tick_s):
            try:
                self._watch_once()
            except Exception:  # never end quietly: the next tick tries again
                log.exception("stage watchdog check failed")

    def _watch_once(self) -> None:
        procs = dict(self.stages.procs)
        seen = self.host.hang({stage: is_stopped(proc) for stage, proc in procs.items() if proc.local})
        if seen is None:
            return
        epoch, hang = seen
        proc = procs.get(hang.stage)
        role = hang.stage.role
        if proc is None or not proc.local:
            self.host.on_broken(hang.stage, epoch, f"{role} stage hung: {hang.why}; not a process to kill here")
            return
        self.host.on_broken(hang.stage, epoch, f"{role} stage hung: {hang.why}; killing its process {proc.pid}")
        if not kill(proc):  # after the loss is declared: the broken stream then reads as this hang, not a death
            log.error("could not kill the hung %s stage's process %d", role, proc.pid)
