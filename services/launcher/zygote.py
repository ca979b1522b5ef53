"""Stage processes forked from a preloaded template process (``CDB_STAGE_FORK``, on by default on Linux).

A stage process spends nearly all of its start importing torch (about 2 CPU-s on a small host): three stages,
their standbys and every restart after a crash paid it again. The tree instead starts one *zygote*
(``python -m cdb.zygote --resolved-config DOC``, ``cdb.zygote``) that imports what a stage imports and then forks a
stage for each request of the launcher: a stage starts, or restarts, in a fraction of a second, and the stages
share the imported pages copy-on-write.

The zygote runs no thread of its own and makes no gRPC object before it forks (gRPC's fork handlers then have
nothing to do). It forks twice: its child forks the stage and exits, so that the stage is re-parented to the
launcher, which has made itself a child subreaper (``PR_SET_CHILD_SUBREAPER``) and so reaps the stage, reads its
exit status and signals it as a child it started itself (:class:`ForkedStage`, ``subprocess.Popen``'s interface).
The stage waits until it is the launcher's child (``die_with_parent`` then holds as for any child), starts a
session of its own, writes to its log file, takes the environment it was given and runs ``cdb stage`` with its
arguments. ``ps`` shows the zygote's command line for it; its name (``comm``, ``ps -o comm``, ``top``) is
``cdb-ROLE``.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping

PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, arg: int | bytes) -> bool:
    """Linux ``prctl(option, arg)``; whether it succeeded."""
    try:
        return int(ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)) == 0
    except OSError:
        return False


# --- the launcher's side ----------------------------------------------------------------------------------------


class Zygote:
    """The template process of one tree; ``spawn`` asks it for a stage. Raises OSError where the launcher cannot
    become a subreaper (then the caller starts fresh interpreters)."""

    def __init__(self, python: str, document: str, env: Mapping[str, str], log_path: str) -> None:
        if not sys.platform.startswith("linux") or not prctl(_PR_SET_CHILD_SUBREAPER, 1):
            raise OSError("this host cannot re-parent forked stages to the launcher")
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [python, "-m", "cdb.zygote", "--resolved-config", document],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                env=dict(env),
                bufsize=0,
            )
        self._pending: deque[ForkedStage] = deque()
        self._lock = threading.Lock()
        self.forked = 0  # stages it has forked

    def spawn(self, argv: list[str], env: Mapping[str, str], log_path: str) -> ForkedStage:
        """A stage running ``cdb ARGV`` (``argv`` without ``-m cdb``), asked for now and forked once the zygote has
        imported what it preloads; a zygote that has ended gives a stage that exited at once (code 1)."""
        stage = ForkedStage(self, argv)
        request = json.dumps({"argv": argv, "env": dict(env), "log": log_path}).encode() + b"\n"
        with self._lock:
            self._pending.append(stage)
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(request)
            except OSError:
                self._ended()
        return stage

    def collect(self, wait: bool) -> None:
        """Note the pids the zygote has answered (in the order asked); ``wait``: until every asked one is known."""
        with self._lock:
            out = self.proc.stdout
            assert out is not None
            while self._pending:
                if not wait and not select.select([out], [], [], 0)[0]:
                    return
                line = out.readline()
                if not line:
                    self._ended()
                    return
                self._pending.popleft().started(int(line))
                self.forked += 1

    def _ended(self) -> None:
        for stage in self._pending:
            stage.returncode = 1
        self._pending.clear()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """End the zygote (its stages are the launcher's: they go on until stopped)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkedStage:
    """A stage process forked by the :class:`Zygote` and re-parented to this process: what the supervisor uses
    of ``subprocess.Popen`` (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``,
    ``kill``)."""

    def __init__(self, zygote: Zygote, argv: list[str]) -> None:
        self.args = argv
        self.returncode: int | None = None
        self._zygote = zygote
        self._pid: int | None = None
        self._reaping = threading.Lock()  # one waitpid at a time (the owner thread and a caller may both poll)

    def started(self, pid: int) -> None:
        if pid > 0:
            self._pid = pid
        else:
            self.returncode = 1

    @property
    def pid(self) -> int:
        if self._pid is None and self.returncode is None:
            self._zygote.collect(wait=True)
        return self._pid if self._pid is not None else -1

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._pid is None:
            self._zygote.collect(wait=False)
            if self._pid is None:
                return self.returncode  # still being forked (None), or never was (1)
        with self._reaping:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self._pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: gone, its status unknown
                    self.returncode = 1
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)  # (a child of this process; its exit is noticed within a tick)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self.pid > 0:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
