"""What a child of the tree (``cdb stage``, ``cdb scheduler``, ``cdb frontend``) does at its own start: get SIGTERM
when the launcher dies, and pin itself to the CPUs ``CDB_CPUS`` gives its role."""

from __future__ import annotations

import os
import resource
import signal

from services.settings.checks import cpu_map
from services.settings.knobs import Settings
from services.settings.source import load_settings

PARENT_ENV = "CDB_PARENT_PID"  # the launcher's pid, in each child's environment
_MAX_OPEN_FILES = 1 << 20  # where the hard limit is unlimited (the kernel's usual nr_open)


def raise_open_files() -> int:
    """Raise this process's soft limit on open files to its hard limit (a server's connections and a tree's sockets
    and segments outgrow the usual soft default of 1,024 long before the host's limit); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft
    return want


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
