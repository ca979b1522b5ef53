"""``ServeHandle``: the running tree and its supervisor (the package docstring, "Supervision"). One owner thread
starts, restarts and stops every child; a child that exits is restarted by ``RestartPolicy``, or given up on."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from cdb_scheduler.plan import Stage
from services.launcher.child import PARENT_ENV
from services.launcher.commands import FRONTEND_PREFIX, STANDBY_SUFFIX
from services.launcher.restarts import Restart, RestartPolicy
from services.launcher.zygote import ForkedStage, Zygote
from services.settings.knobs import Settings

log = logging.getLogger("cdb.launcher")
_SUPERVISE_PERIOD_S = 0.1
_T = TypeVar("_T")
Process = subprocess.Popen[bytes] | ForkedStage  # a child: a fresh interpreter, or a stage forked by the zygote


class SpawnError(RuntimeError):
    """A child process could not be started (its interpreter missing or not executable, no fds or memory)."""


@dataclasses.dataclass(slots=True)
class _Child:
    name: str  # "scheduler" or a stage role
    argv: list[str]
    env: Mapping[str, str] | None
    ready_file: str | None
    proc: Process | None = None
    streak: int = 0  # exits in a row without readiness in between
    exited: tuple[int, float] = (0, 0.0)  # the last exit: code, when it was seen
    restart_at: float | None = None  # a restart is due then (backoff)

    @property
    def what(self) -> str:
        if self.name.startswith(FRONTEND_PREFIX):
            return f"front end {self.name.removeprefix(FRONTEND_PREFIX)}"
        return "the scheduler" if self.name == "scheduler" else f"the {self.name} stage"


class ServeHandle:
    """The running tree. ``stop()`` ends it: scheduler first (it drains), then the stages. Every child is started,
    restarted and stopped on the handle's owner thread (``cdb-tree``), whichever thread asks."""

    def __init__(self, workdir: str, settings: Settings) -> None:
        self.workdir = workdir
        self.log_dir = settings.log_dir or workdir  # each child's NAME.log (CDB_LOG_DIR: kept after the tree)
        self.settings = settings
        self.address = ""
        self.stage_addrs: dict[Stage, str] = {}
        self.standby_addrs: dict[Stage, str] = {}  # CDB_STANDBY_STAGES
        self.python = sys.executable  # the interpreter the children run under
        self.policy = RestartPolicy.from_settings(settings)
        self.restarts: list[Restart] = []
        self.failed: str | None = None  # why supervision gave up (the tree is then stopped)
        self.ended = threading.Event()  # the tree has stopped: stop() or supervision gave up
        self._children: dict[str, _Child] = {}
        self._zygote: Zygote | None = None  # owner thread only: the stages' template process (CDB_STAGE_FORK)
        self._supervising = False  # owner thread only
        self._stopping: float | None = None  # owner thread only: stop asked, with this drain timeout
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
        self._calls_lock = threading.Lock()
        self._closed = False  # the owner takes no more calls
        self._owner = threading.Thread(target=self._own, name="cdb-tree", daemon=True)
        self._owner.start()

    # --- asking the owner thread ------------------------------------------------------------------------------

    def _on_owner(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the owner thread and return its result (or raise its exception)."""
        if threading.current_thread() is self._owner:
            return fn()
        done: Future[object] = Future()
        with self._calls_lock:
            if self._closed:
                raise RuntimeError(f"the tree is stopped{f' ({self.failed})' if self.failed else ''}")
            self._calls.put((fn, done))
        return done.result()  # type: ignore[return-value]

    def start_child(
        self, name: str, argv: list[str], env: Mapping[str, str] | None, ready_file: str | None = None
    ) -> Process:
        """Start ``python ARGV`` as the child ``name`` (``scheduler`` or a stage role); ``ready_file``: where it
        announces readiness (a restart removes it first). Raises SpawnError if it cannot be started."""
        child = _Child(name, argv, env, ready_file)

        def start() -> Process:
            if name in self._children:
                raise ValueError(f"the tree already has a {name}")
            child.proc = self._popen(child)
            self._children[name] = child
            return child.proc

        return self._on_owner(start)

    def supervise(self) -> None:
        """Restart children that die from now on."""
        self._on_owner(lambda: setattr(self, "_supervising", True))

    def unsupervise(self) -> None:
        """Stop restarting children (an operator who restarts them by other means; tests of a stage that stays
        down); once this returns no restart happens. ``stop`` still ends them all."""
        with contextlib.suppress(RuntimeError):  # already stopped
            self._on_owner(lambda: setattr(self, "_supervising", False))

    # --- the owner thread -------------------------------------------------------------------------------------

    def _own(self) -> None:
        try:
            while self._stopping is None and self.failed is None:
                try:
                    fn, done = self._calls.get(timeout=_SUPERVISE_PERIOD_S if self._supervising else None)
                except queue.Empty:
                    pass
                else:
                    try:
                        done.set_result(fn())
                    except BaseException as exc:  # the asker gets it
                        done.set_exception(exc)
                if self._supervising and self._stopping is None:
                    self._watch()
        except BaseException as exc:  # a fault of the supervisor itself: never end quietly
            self.failed = f"the supervisor failed: {type(exc).__name__}: {exc}"
            log.exception("cdb: %s; stopping the tree", self.failed)
        finally:
            with self._calls_lock:
                self._closed = True
            while True:  # calls that came too late
                try:
                    _, done = self._calls.get_nowait()
                except queue.Empty:
                    break
                done.set_exception(RuntimeError("the tree is stopped"))
            drain = self.settings.drain_timeout_s if self._stopping is None else self._stopping
            _terminate(self.frontends, drain + 10.0)  # they drain their requests over the running engine
            scheduler = [c.proc for n, c in self._children.items() if n == "scheduler" and c.proc is not None]
            _terminate(scheduler, drain + 10.0)
            _terminate(list(self.stages.values()) + list(self.standbys.values()), 10.0)
            if self._zygote is not None:
                self._zygote.close()
            self.ended.set()

    def _popen(self, child: _Child) -> Process:
        cmd = [self.python, *child.argv]
        child_env = dict(os.environ if child.env is None else child.env)
        child_env[PARENT_ENV] = str(os.getpid())
        zygote = self._zygote_for(child, child_env)
        if zygote is not None:  # (argv: ``-m cdb stage ...``)
            return zygote.spawn(child.argv[2:], child_env, self.log_path(child.name))
        try:
            with open(self.log_path(child.name), "ab") as out:
                # A session of its own: a terminal's Ctrl-C reaches the launcher only, which stops the children
                # in order.
                return subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=child_env
                )
        except (OSError, subprocess.SubprocessError) as exc:
            raise SpawnError(f"cannot start {child.what} ({exc})") from exc

    def _zygote_for(self, child: _Child, env: Mapping[str, str]) -> Zygote | None:
        """The zygote that forks ``child`` (a stage or a standby, where ``CDB_STAGE_FORK`` is on), started at the
        first one and again if it ended; None: start it as a fresh interpreter."""
        if not self.settings.stage_fork or child.argv[2:3] != ["stage"] or "--resolved-config" not in child.argv:
            return None
        old = self._zygote
        if old is not None and old.alive:
            return old
        problem = None
        if old is not None and not old.forked:  # it ended before forking anything: it cannot here
            problem = f"the stage zygote exited with code {old.proc.returncode} (zygote.log)"
        else:
            document = child.argv[child.argv.index("--resolved-config") + 1]
            try:
                self._zygote = Zygote(self.python, document, env, self.log_path("zygote"))
            except OSError as exc:
                problem = str(exc)
        if problem is not None:
            log.warning("cdb: stages start as fresh interpreters: %s", problem)
            self.settings = dataclasses.replace(self.settings, stage_fork=False)
            return None
        return self._zygote

    def _watch(self) -> None:
        """One look at every child: note readiness, restart the dead (or give up on them)."""
        now = time.monotonic()
        for child in self._children.values():
            if self.failed is not None:
                return
            if child.streak and child.ready_file and os.path.exists(child.ready_file):
                child.streak = 0  # it served again: its next exit starts a new streak
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._restart(child, now)
                continue
            code = child.proc.poll() if child.proc is not None else None
            if code is None:
                continue
            child.streak += 1
            child.exited = (code, now)
            delay = self.policy.delay(child.streak)
            if delay is None:
                self._give_up(f"{child.what} exited with code {code}, {child.streak} times in a row without serving")
            elif child.name == "scheduler" and _any_port(child.argv):
                self._give_up(f"the scheduler exited with code {code} (its port was chosen at random)")
            else:
                wait = f" in {delay:g}s ({child.streak} exits in a row)" if delay else ""
                log.warning("cdb: %s exited with code %s; restarting it%s", child.what, code, wait)
                child.restart_at = now + delay
                if not delay:
                    self._restart(child, now)

    def _restart(self, child: _Child, now: float) -> None:
        if child.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(child.ready_file)
        child.restart_at = None
        try:
            child.proc = self._popen(child)
        except SpawnError as exc:
            self._give_up(str(exc))
            return
        self.restarts.append(Restart(child.name, child.exited[0], child.exited[1], now, child.streak))

    def _give_up(self, why: str) -> None:
        self.failed = why
        log.error("cdb: %s; stopping the tree", why)

    # --- the tree as a whole ----------------------------------------------------------------------------------

    @property
    def given_up(self) -> bool:
        return self.failed is not None

    @property
    def stages(self) -> dict[Stage, Process]:
        """The first stage process of each role now (a restart replaces one; see ``standbys``)."""
        return {
            Stage.from_role(n): c.proc
            for n, c in list(self._children.items())
            if n in Stage.roles() and c.proc is not None
        }

    @property
    def standbys(self) -> dict[Stage, Process]:
        """The warm standby stage process of each role (``CDB_STANDBY_STAGES``); whichever of a role's two serves,
        the other waits, model loaded."""
        return {
            Stage.from_role(n.removesuffix(STANDBY_SUFFIX)): c.proc
            for n, c in list(self._children.items())
            if n.endswith(STANDBY_SUFFIX) and c.proc is not None
        }

    @property
    def scheduler(self) -> Process | None:
        child = self._children.get("scheduler")
        return child.proc if child is not None else None

    @property
    def frontends(self) -> list[Process]:
        """The front-end processes now (``CDB_FRONTENDS``), in start order."""
        return [c.proc for n, c in list(self._children.items()) if n.startswith(FRONTEND_PREFIX) and c.proc]

    def set_argv(self, name: str, argv: list[str]) -> None:
        """What a child runs when it is restarted from now on."""

        def put() -> None:
            self._children[name].argv = argv

        self._on_owner(put)

    def processes(self) -> list[Process]:
        procs = (*self.frontends, self.scheduler, *self.stages.values(), *self.standbys.values())
        return [p for p in procs if p is not None]

    def log_path(self, name: str) -> str:
        """Where the child ``name`` writes its output."""
        return os.path.join(self.log_dir, f"{name}.log")

    def exited(self, name: str) -> bool:
        """Whether the child ``name`` was started and has exited (for error messages)."""
        child = self._children.get(name)
        return child is not None and child.proc is not None and child.proc.poll() is not None

    def log(self, name: str) -> str:
        """A child's output so far (``scheduler`` or a role name); for error messages and tests."""
        path = self.log_path(name)
        return Path(path).read_text(errors="replace") if os.path.exists(path) else ""

    def stop(self, drain_timeout: float | None = None) -> None:
        """SIGTERM the scheduler and wait for its drain, then the stages; SIGKILL what does not exit. Idempotent;
        returns once every child has exited."""
        drain = self.settings.drain_timeout_s if drain_timeout is None else drain_timeout

        def ask() -> None:
            self._stopping = drain

        with contextlib.suppress(RuntimeError):  # stopped already (or giving up: it stops on its own)
            self._on_owner(ask)
        if threading.current_thread() is not self._owner:
            self._owner.join()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ServeHandle:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _any_port(argv: list[str]) -> bool:
    """The child listens on port 0 (a restart would move it)."""
    listen = argv[argv.index("--listen") + 1] if "--listen" in argv else ""
    return listen.endswith(":0")


def _terminate(procs: Sequence[Process], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
