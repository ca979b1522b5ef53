"""What a child of the tree (``cdb stage``, ``cdb scheduler``, ``cdb frontend``) does at its own start: get SIGTERM
when the launcher dies, and pin itself to the CPUs ``CDB_CPUS`` gives its role."""

from __future__ import annotations

import os
import signal

from services.settings.checks import cpu_map
from services.settings.knobs import Settings
from services.settings.source import load_settings

PARENT_ENV = "CDB_PARENT_PID"  # the launcher's pid, in each child's environment


def pin_cpus(role: str, settings: Settings | None = None) -> None:
    """Pin this process (``role`` of the tree) to the CPUs ``CDB_CPUS`` gives it, if any: on a small host the
    loop stage can then own a core instead of time-sharing it with the head, prelude and scheduler."""
    cpus = cpu_map((settings or load_settings()).cpus).get(role)
    if cpus:
        os.sched_setaffinity(0, cpus)


def die_with_parent() -> None:
    """In a child of the tree (``cdb stage`` / ``cdb scheduler``): get SIGTERM when the launcher dies.

    Set by the child itself at start (``PR_SET_PDEATHSIG``), not between fork and exec: running Python code there
    breaks gRPC's fork handlers when the launching process uses gRPC itself. The signal comes when the *thread*
    that forked the child ends, which is why the launcher forks every child from the tree's owner thread. A
    launcher already gone by then (the parent is no longer the one recorded in ``CDB_PARENT_PID``) ends the child
    at once."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)
