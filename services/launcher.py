"""The process tree on this machine: three stage servers, then the scheduler service, as child processes.

- ``serve_all(config, listen) -> ServeHandle``: starts the stages (Unix sockets in a private temp dir) and the
  scheduler (``cdb stage`` / ``cdb scheduler``), waits until each one is ready, returns a handle (``address``,
  ``stop()``).
- ``start_stages(config)``: only the three stages (benchmarks drive them from an in-process engine).
- ``serve_forever(resolved, listen)``: ``serve_all``, then serve until SIGTERM / SIGINT (Ctrl-C) / SIGHUP (a closed
  terminal), and stop every child (scheduler first, so it drains; then the stages).

Supervision: the handle restarts a child that dies (same command, same address): a restarted stage is re-attached by
the scheduler, which recomputes the requests it was running; a restarted scheduler re-configures the stages (they
dropped the dead one's session). A stage that hangs is the scheduler's to judge: its watchdog SIGKILLs the stuck
process (``services.transport.watchdog``) and the handle restarts it like any dead stage, so the scheduler itself is
never restarted for a stage's fault. One thread of the handle, the tree's owner, starts, restarts and stops every
child, and lives until the tree has stopped: a child's ``PR_SET_PDEATHSIG`` follows the thread that forked it, so
children started anywhere else would die with that thread, cutting a drain short.

- A child's *streak* counts its exits in a row with no readiness in between (its ready file is removed before
  each restart and written again once it serves), however long each try lasted. The first exit restarts it at
  once; each further one waits ``CDB_RESTART_BACKOFF_S`` (0.5 s), doubling, at most ``CDB_RESTART_BACKOFF_MAX_S``
  (30 s). The ``CDB_RESTART_LIMIT``-th (5th) exit of a streak gives up on the child.
- Giving up, and failing to start a child again (a missing or broken interpreter, no file descriptors left), stop
  the tree with one error line (logger ``cdb.launcher``); ``serve_forever`` then exits 1. So does a scheduler
  that dies while listening on port 0 (a restart would move it).

Configuration: the tree's ``Resolved`` configuration (its engine config and settings) is written once, as one JSON
document in the private work dir (mode 0600), and every child gets ``--resolved-config FILE`` beside the options
of its own place in the tree (role, addresses, ready file): no setting is re-serialised into a child's argv or
environment, and the child reads neither its ``CDB_*`` variables nor a config file. The stage plane's secret:
unless the settings name one (``CDB_STAGE_SECRET_FILE`` / ``CDB_STAGE_SECRET``), the tree makes its own in the work
dir (mode 0600) and the document names it.

Readiness: each child writes its bound address to a ready file (``services.net.write_ready_file``) once it
serves (the scheduler: once its health is SERVING); the launcher waits for those files and fails fast if a
child exits first.

Shared memory: a start sweeps the segments that trees SIGKILLed whole left in ``/dev/shm``
(``services.transport.segments``).
"""

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
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from cdb_engine.config import EngineConfig
from cdb_engine.limits import describe, resolve_limits
from cdb_model.loader import load_config
from cdb_scheduler.plan import Stage
from services.net import wait_ready_file
from services.settings.checks import cpu_map
from services.settings.knobs import Settings
from services.settings.resolved import Resolved
from services.settings.source import load_settings
from services.stage_secret import create_secret_file
from services.transport.segments import sweep_stale_segments

log = logging.getLogger("cdb.launcher")

# --- the process tree -----------------------------------------------------------------------------------------


PARENT_ENV = "CDB_PARENT_PID"
_SUPERVISE_PERIOD_S = 0.1
STANDBY_SUFFIX = "-standby"  # the child name of a role's warm standby stage (``CDB_STANDBY_STAGES``)
FRONTEND_PREFIX = "frontend-"  # child names of the front-end processes (``CDB_FRONTENDS``): frontend-0, ...
_T = TypeVar("_T")


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


class SpawnError(RuntimeError):
    """A child process could not be started (its interpreter missing or not executable, no fds or memory)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When a child that exited is restarted, and when it is given up on (module docstring, "Supervision")."""

    backoff_s: float  # the delay before the 2nd restart of a streak (the 1st is at once), doubling
    backoff_max_s: float  # the longest delay
    limit: int  # the exit of a streak that gives up

    @classmethod
    def from_settings(cls, settings: Settings) -> RestartPolicy:
        return cls(settings.restart_backoff_s, settings.restart_backoff_max_s, settings.restart_limit)

    def delay(self, streak: int) -> float | None:
        """Seconds before restarting a child whose streak (its exits in a row, the last one included) is
        ``streak``; None: give up on it."""
        if streak >= self.limit:
            return None
        if streak <= 1:
            return 0.0
        return float(min(self.backoff_s * 2 ** (streak - 2), self.backoff_max_s))


@dataclasses.dataclass(frozen=True, slots=True)
class Restart:
    """One restart: ``code`` is the exit status of the process replaced (negative: the signal that ended it);
    times are ``time.monotonic()``; ``streak`` counts that process's exit."""

    name: str
    code: int
    exited_at: float
    started_at: float
    streak: int


@dataclasses.dataclass(slots=True)
class _Child:
    name: str  # "scheduler" or a stage role
    argv: list[str]
    env: Mapping[str, str] | None
    ready_file: str | None
    proc: subprocess.Popen[bytes] | None = None
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
    ) -> subprocess.Popen[bytes]:
        """Start ``python ARGV`` as the child ``name`` (``scheduler`` or a stage role); ``ready_file``: where it
        announces readiness (a restart removes it first). Raises SpawnError if it cannot be started."""
        child = _Child(name, argv, env, ready_file)

        def start() -> subprocess.Popen[bytes]:
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
            self.ended.set()

    def _popen(self, child: _Child) -> subprocess.Popen[bytes]:
        cmd = [self.python, *child.argv]
        child_env = dict(os.environ if child.env is None else child.env)
        child_env[PARENT_ENV] = str(os.getpid())
        try:
            with open(os.path.join(self.workdir, f"{child.name}.log"), "ab") as out:
                # A session of its own: a terminal's Ctrl-C reaches the launcher only, which stops the children
                # in order.
                return subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=child_env
                )
        except (OSError, subprocess.SubprocessError) as exc:
            raise SpawnError(f"cannot start {child.what} ({exc})") from exc

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
    def stages(self) -> dict[Stage, subprocess.Popen[bytes]]:
        """The first stage process of each role now (a restart replaces one; see ``standbys``)."""
        return {
            Stage.from_role(n): c.proc
            for n, c in list(self._children.items())
            if n in Stage.roles() and c.proc is not None
        }

    @property
    def standbys(self) -> dict[Stage, subprocess.Popen[bytes]]:
        """The warm standby stage process of each role (``CDB_STANDBY_STAGES``); whichever of a role's two serves,
        the other waits, model loaded."""
        return {
            Stage.from_role(n.removesuffix(STANDBY_SUFFIX)): c.proc
            for n, c in list(self._children.items())
            if n.endswith(STANDBY_SUFFIX) and c.proc is not None
        }

    @property
    def scheduler(self) -> subprocess.Popen[bytes] | None:
        child = self._children.get("scheduler")
        return child.proc if child is not None else None

    @property
    def frontends(self) -> list[subprocess.Popen[bytes]]:
        """The front-end processes now (``CDB_FRONTENDS``), in start order."""
        return [c.proc for n, c in list(self._children.items()) if n.startswith(FRONTEND_PREFIX) and c.proc]

    def set_argv(self, name: str, argv: list[str]) -> None:
        """What a child runs when it is restarted from now on."""

        def put() -> None:
            self._children[name].argv = argv

        self._on_owner(put)

    def processes(self) -> list[subprocess.Popen[bytes]]:
        procs = (*self.frontends, self.scheduler, *self.stages.values(), *self.standbys.values())
        return [p for p in procs if p is not None]

    def log(self, name: str) -> str:
        """A child's output so far (``scheduler`` or a role name); for error messages and tests."""
        path = os.path.join(self.workdir, f"{name}.log")
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


def _terminate(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
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


def stage_command(role: str, listen: str, ready_file: str, document: str) -> list[str]:
    """``python ARGV`` of a stage child: its place in the tree, and the tree's configuration ``document``."""
    place = ["--role", role, "--listen", listen, "--ready-file", ready_file]
    return ["-m", "cdb", "stage", *place, "--resolved-config", document]


def scheduler_command(
    listen: str, ready_file: str, stages: Mapping[Stage, str], standbys: Mapping[Stage, str], document: str
) -> list[str]:
    """``python ARGV`` of the scheduler child: its addresses and its stages', and the tree's ``document``."""
    place = ["--listen", listen, "--ready-file", ready_file]
    place += [f"--stage={s.role}={addr}" for s, addr in stages.items()]
    place += [f"--standby-stage={s.role}={addr}" for s, addr in standbys.items()]
    return ["-m", "cdb", "scheduler", *place, "--resolved-config", document]


def frontend_command(listen: str, ready_file: str, link: str, document: str, join: bool) -> list[str]:
    """``python ARGV`` of a front-end child (``CDB_FRONTENDS``): its public address, the scheduler's link."""
    place = ["--listen", listen, "--ready-file", ready_file, f"--link={link}", *(["--join"] if join else [])]
    return ["-m", "cdb", "frontend", *place, "--resolved-config", document]


def serve_all(
    config: EngineConfig,
    listen: str = "127.0.0.1:50051",
    *,
    settings: Settings | None = None,
    env: Mapping[str, str] | None = None,
    metrics_listen: str | None = None,
) -> ServeHandle:
    """Start three stage servers and the scheduler service; return once all are ready. The tree runs with
    ``config`` and ``settings`` (None: those of ``env``'s ``CDB_*`` variables and config file, ``env`` also being
    the children's environment; default: this process's); ``metrics_listen``: the scheduler's metrics address over
    ``settings.metrics_addr``."""
    return _start_tree(config, listen, settings, env, metrics_listen)


def start_stages(
    config: EngineConfig, *, settings: Settings | None = None, env: Mapping[str, str] | None = None
) -> ServeHandle:
    """Start only the three stage servers (``handle.stage_addrs``), e.g. for an in-process ``Engine`` over
    ``GrpcExecutorFactory`` (benchmarks); return once all are ready."""
    return _start_tree(config, None, settings, env)


def _start_tree(
    config: EngineConfig,
    listen: str | None,
    settings: Settings | None,
    env: Mapping[str, str] | None,
    metrics_listen: str | None = None,
) -> ServeHandle:
    settings = settings or load_settings(env)
    if metrics_listen is not None:
        settings = dataclasses.replace(settings, metrics_addr=metrics_listen)
    sweep_stale_segments()  # what trees SIGKILLed whole left behind (their owners are gone)
    workdir = tempfile.mkdtemp(prefix="cdb-serve-")
    if not (settings.stage_secret_file or settings.stage_secret):
        secret_file = os.path.join(workdir, "stage.secret")
        create_secret_file(secret_file)
        settings = dataclasses.replace(settings, stage_secret_file=secret_file)
    document = os.path.join(workdir, "config.json")
    Resolved(settings, config).write(document)  # what every child runs with (module docstring)
    handle = ServeHandle(workdir, settings)
    fronts = settings.frontends if listen is not None else 0
    try:
        # Unix socket paths are known in advance, so the scheduler starts with the stages and connects as soon
        # as they listen (it waits for them): start-up costs one interpreter + torch import, not two.
        names = {stage: stage.role for stage in Stage}
        standby = {stage: stage.role + STANDBY_SUFFIX for stage in Stage} if settings.standby_stages else {}
        ready = {n: os.path.join(handle.workdir, f"{n}.ready") for n in (*names.values(), *standby.values())}
        sockets = {n: f"unix://{handle.workdir}/{n}.sock" for n in ready}
        for stage, name in [*names.items(), *standby.items()]:
            handle.start_child(name, stage_command(stage.role, sockets[name], ready[name], document), env, ready[name])
        sched_ready = os.path.join(handle.workdir, "scheduler.ready")
        link = f"unix:{handle.workdir}/link.sock"
        if listen is not None:
            stage_socks = {s: sockets[n] for s, n in names.items()}
            standby_socks = {s: sockets[n] for s, n in standby.items()}
            # with front ends the scheduler's own gRPC port is private; the front ends take ``listen``
            inner = f"unix://{handle.workdir}/scheduler.sock" if fronts else listen
            argv = scheduler_command(inner, sched_ready, stage_socks, standby_socks, document)
            if fronts:
                argv.append(f"--link={link}")
            handle.start_child("scheduler", argv, env, sched_ready)
            if fronts:  # the first front end starts beside the scheduler (it connects once the link listens)
                _spawn_frontend(handle, 0, listen, link, document, env, join=False)
        for stage, proc in handle.stages.items():
            timeout = settings.ready_timeout_s
            handle.stage_addrs[stage] = wait_ready_file(ready[stage.role], proc, timeout, f"{stage.role} stage")
        for stage, proc in handle.standbys.items():
            what = f"{stage.role} standby stage"
            handle.standby_addrs[stage] = wait_ready_file(ready[standby[stage]], proc, settings.ready_timeout_s, what)
        if handle.scheduler is not None:
            handle.address = wait_ready_file(sched_ready, handle.scheduler, settings.ready_timeout_s, "scheduler")
        if fronts:
            handle.address = _start_frontends(handle, fronts, link, document, env)
        handle.supervise()
    except BaseException as exc:
        logged = ("scheduler", *Stage.roles(), *(f"{FRONTEND_PREFIX}{i}" for i in range(fronts)))
        logs = "\n".join(f"--- {n}.log ---\n{handle.log(n)[-2000:]}" for n in logged)
        handle.stop(drain_timeout=0.0)
        if isinstance(exc, RuntimeError):
            raise RuntimeError(f"{exc}\n{logs}") from exc
        raise
    return handle


def _frontend_ready(handle: ServeHandle, i: int) -> str:
    return os.path.join(handle.workdir, f"{FRONTEND_PREFIX}{i}.ready")


def _spawn_frontend(
    handle: ServeHandle, i: int, listen: str, link: str, document: str, env: Mapping[str, str] | None, join: bool
) -> subprocess.Popen[bytes]:
    ready = _frontend_ready(handle, i)
    argv = frontend_command(listen, ready, link, document, join)
    return handle.start_child(f"{FRONTEND_PREFIX}{i}", argv, env, ready)


def _start_frontends(handle: ServeHandle, count: int, link: str, document: str, env: Mapping[str, str] | None) -> str:
    """Once the first front end (started with the scheduler) has bound the public address (port 0: any), start
    the other ``count - 1`` on the bound port; return the public address. A restarted front end joins it too."""
    timeout = handle.settings.ready_timeout_s
    address = wait_ready_file(_frontend_ready(handle, 0), handle.frontends[0], timeout, "front end 0")
    restart = frontend_command(address, _frontend_ready(handle, 0), link, document, count > 1)
    handle.set_argv(f"{FRONTEND_PREFIX}0", restart)
    for i in range(1, count):
        proc = _spawn_frontend(handle, i, address, link, document, env, join=True)
        wait_ready_file(_frontend_ready(handle, i), proc, timeout, f"front end {i}")
    return address


def stop_signals() -> threading.Event:
    """Make SIGTERM, SIGINT (Ctrl-C) and SIGHUP (the terminal closed) set the event returned: a graceful stop.
    Main thread only."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_end(handle: ServeHandle, stop: threading.Event) -> int:
    """Serve until ``stop`` is set (exit status 0) or the supervisor stops the tree (1: it gave up, or could not
    restart a child; it has logged why in one line). The tree is stopped when this returns."""
    while not (stop.is_set() or handle.ended.is_set()):
        stop.wait(0.2)  # a watch period over both ends; a signal sets ``stop`` at once
    handle.stop()
    return 1 if handle.given_up else 0


def serve_forever(resolved: Resolved, listen: str = "127.0.0.1:50051") -> int:
    """Run the tree with ``resolved`` in the foreground until SIGTERM / Ctrl-C / SIGHUP (exit 0), or until the
    supervisor gives up on a child or cannot restart it (exit 1)."""
    config, settings = resolved.engine, resolved.settings
    try:
        handle = serve_all(config, listen, settings=settings)
    except RuntimeError as exc:  # a child failed to start: its log tail follows the first line
        print(f"cdb serve: {exc}", file=sys.stderr)
        return 1
    stop = stop_signals()
    limits = resolve_limits(config, load_config(config.model))
    n = settings.frontends
    fronts = f"; {n} front-end process{'es' if n > 1 else ''}" if n else ""
    print(f"cdb serving {config.model} on {handle.address} (stages: prelude, loop, head{fronts})", flush=True)
    print(f"  {describe(limits)}", flush=True)
    if config.synthetic_cost:
        print(f"  SYNTHETIC stages: modelled device time {config.synthetic_cost}; tokens mean nothing", flush=True)
    if settings.http_addr:
        print(f"OpenAI-compatible HTTP API on http://{settings.http_addr}/v1", flush=True)
    if settings.metrics_addr:
        print(f"Prometheus metrics on http://{settings.metrics_addr}/metrics", flush=True)
    return wait_for_end(handle, stop)
