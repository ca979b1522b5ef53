"""The scheduler's hang watchdog: which stage is hung, and the process identity that lets it be replaced.

A stage that hangs without dying (stopped by SIGSTOP, or stuck inside an op while its gRPC server still answers
keepalive pings) is treated as lost, exactly like a dead one (``GrpcExecutor``: ``StageLoss``, the running
requests recomputed), and its process is SIGKILLed so that its supervisor starts a fresh one. ``HangWatch`` is
the rule, on plain numbers (unit-tested with a made-up clock); the executor feeds it each stage's replies and
asks it about the oldest outstanding op of each stage, every ``tick_s``.

The rule, per stage. The stage's *head op* is its oldest op without a reply; it is *runnable* once every op it
is fenced on has replied (before that, a wait is the other stage's doing). A head op runnable for longer than

    budget = max(CDB_STAGE_HANG_FLOOR_S, CDB_STAGE_HANG_FACTOR x pace x units)   (x 2 per earlier verdict)

hangs the stage. ``units`` are the op's token-steps (tokens; x steps for a prefill loop op; + fused head tokens);
``pace`` is the slowest compute time per unit among the stage's last ``PACE_WINDOW`` replies (none before its
first reply: the floor alone). Each such verdict on a stage doubles its budget from then on, so a stage that is
slow rather than hung is not killed over and over. Separately, a stage process on this host seen stopped (state
``T``: SIGSTOP, SIGTSTP) on two checks in a row while it holds ops hangs the stage at once: a stopped process
makes no progress whatever its op.

Killing: a stage reports its process (``ConfigureResponse.process``: pid, pid namespace, start time). When that
namespace is the scheduler's own (``cdb serve``: every process of the tree on one host), the scheduler SIGKILLs
it, after checking that the pid still belongs to the process that answered (its start time). Elsewhere (a stage
in another container or host) the loss is declared all the same, and the orchestrator's liveness probe must
replace the process.
"""

from __future__ import annotations

import functools
import os
import signal
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from cdb_scheduler.plan import LoopOp, Stage, StageOp

PACE_WINDOW = 32  # replies per stage whose pace is remembered


def op_units(op: StageOp) -> int:
    """The work of ``op`` in token-steps (at least 1), the unit of a stage's pace."""
    units = len(op.rows)
    if isinstance(op, LoopOp):
        units *= op.num_steps if op.prefill else 1
        units += len(op.head.rows) if op.head is not None else 0
    return max(1, units)


@dataclass(frozen=True, slots=True)
class OldestOp:
    """A stage's oldest op without a reply, as the watchdog sees it."""

    seq: int
    units: int
    runnable: bool  # every op it is fenced on has replied


@dataclass(frozen=True, slots=True)
class Hang:
    """A verdict: ``stage`` is hung; ``why`` says how it was seen."""

    stage: Stage
    why: str


@dataclass(slots=True)
class _StageWatch:
    paces: deque[float] = field(default_factory=lambda: deque(maxlen=PACE_WINDOW))
    head: int | None = None  # the head op seen runnable at the last check
    since: float = 0.0  # when it was first seen runnable
    stopped: bool = False  # its process was seen stopped at the last check
    verdicts: int = 0


class HangWatch:
    """The hang rule (module docstring) over the figures the executor feeds it. Not thread-safe: the executor
    calls it under its own lock."""

    def __init__(self, floor_s: float, factor: float) -> None:
        self.floor_s = floor_s
        self.factor = factor
        self.tick_s = min(0.1, floor_s / 4)  # how often the executor checks
        self._stages = {stage: _StageWatch() for stage in Stage}

    def on_reply(self, stage: Stage, units: int, compute_s: float) -> None:
        """A reply of ``stage`` to an op of ``units`` that computed for ``compute_s`` seconds."""
        self._stages[stage].paces.append(compute_s / max(1, units))

    def budget(self, stage: Stage, units: int) -> float:
        """How long an op of ``units`` may run on ``stage`` before the stage is judged hung (seconds)."""
        w = self._stages[stage]
        base = self.floor_s
        if w.paces:
            base = max(base, self.factor * max(w.paces) * units)
        return base * 2**w.verdicts

    def check(
        self, now: float, heads: Mapping[Stage, OldestOp | None], stopped: Mapping[Stage, bool] | None = None
    ) -> Hang | None:
        """The first hung stage at time ``now`` (``time.monotonic``), or None. ``heads``: each stage's head op
        (None: nothing outstanding); ``stopped``: which stage processes are stopped now (those on this host)."""
        stopped = stopped or {}
        for stage, head in heads.items():
            w = self._stages[stage]
            was_stopped, w.stopped = w.stopped, bool(head is not None and stopped.get(stage))
            if head is None or not head.runnable:
                w.head = None
            elif w.head != head.seq:
                w.head, w.since = head.seq, now
            if head is None:
                continue
            if w.stopped and was_stopped:
                self.reset()
                return Hang(stage, f"its process is stopped (SIGSTOP) holding op {head.seq}")
            if w.head is not None and now - w.since > (budget := self.budget(stage, head.units)):
                ran = now - w.since
                w.verdicts += 1  # slow rather than hung? then it gets longer next time
                self.reset()
                return Hang(stage, f"op {head.seq} has run {ran:.1f}s, past its {budget:.1f}s budget")
        return None

    def reset(self) -> None:
        """Forget what was seen of the ops in flight (a loss voided them); the paces and verdicts stay."""
        for w in self._stages.values():
            w.head, w.stopped = None, False


# --- the process of a stage ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessId:
    """One process on one host: its pid in the pid namespace ``namespace``, and its start time (clock ticks after
    boot), which tells it from a later process given the same pid."""

    pid: int
    namespace: str
    start_ticks: int

    @property
    def local(self) -> bool:
        """In this process's pid namespace, and not this process itself (an in-process stage in tests)."""
        return bool(self.namespace) and self.namespace == _namespace() and self.pid != os.getpid()


def this_process() -> ProcessId:
    """This process's identity (namespace "" where ``/proc`` does not tell: never signalled)."""
    return process(os.getpid()) or ProcessId(os.getpid(), "", 0)


def process(pid: int) -> ProcessId | None:
    """The identity of process ``pid`` of this pid namespace; None if there is none (or no ``/proc``)."""
    stat = _stat(pid)
    return ProcessId(pid, _namespace(), stat[1]) if stat is not None else None


def is_stopped(proc: ProcessId) -> bool:
    """Whether ``proc`` (a local one) exists and is stopped by a signal (state ``T``)."""
    stat = _stat(proc.pid)
    return stat is not None and stat[1] == proc.start_ticks and stat[0] == "T"


def kill(proc: ProcessId) -> bool:
    """SIGKILL ``proc`` if it is local and still the same process; whether it was signalled."""
    if not proc.local:
        return False
    stat = _stat(proc.pid)
    if stat is None or stat[1] != proc.start_ticks:
        return False  # gone already, or the pid is another process's now
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except OSError:  # gone meanwhile, or not ours to signal (another user's)
        return False
    return True


@functools.cache
def _namespace() -> str:
    """This process's pid namespace, as "BOOT_ID/pid:[INODE]" ("" where ``/proc`` does not tell)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of process ``pid`` from ``/proc/PID/stat``; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "PID (COMM) ": the command may hold spaces
    return fields[0], int(fields[19])  # state (field 3), starttime (field 22)
