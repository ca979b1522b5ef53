"""The process tree on this machine: three stage servers, then the scheduler service, as child processes.

- ``serve_all(config, listen) -> ServeHandle``: starts the stages (Unix sockets in a private temp dir) and the
  scheduler (``cdb stage`` / ``cdb scheduler``), waits until each one is ready, returns a handle (``address``,
  ``stop()``).
- ``start_stages(config)``: only the three stages (benchmarks drive them from an in-process engine).
- ``serve_forever(config, listen)``: ``serve_all``, then serve until Ctrl-C / SIGTERM, and stop every child
  (scheduler first, so it drains; then the stages).

Supervision: the handle restarts a child that dies (same command, same address): a restarted stage is
re-attached by the scheduler, which recomputes the requests it was running; a restarted scheduler re-configures
the stages (they dropped the dead one's session). A child that dies more than ``MAX_RESTARTS`` times within
``RESTART_WINDOW_S`` is given up on, and the tree stops (``serve_forever`` exits 1).

The stage plane's secret: unless the environment names one (``CDB_STAGE_SECRET_FILE`` / ``CDB_STAGE_SECRET``),
the tree makes its own in its private work dir (mode 0600) and hands its path to every child.

Readiness: each child writes its bound address to a ready file (``services.net.write_ready_file``) once it
serves (the scheduler: once its health is SERVING); the launcher waits for those files and fails fast if a
child exits first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from cdb_engine.config import EngineConfig
from cdb_engine.limits import describe, resolve_limits
from cdb_engine.options import engine_config_to_argv
from cdb_model.loader import load_config
from cdb_scheduler.plan import Stage
from services.net import wait_ready_file
from services.settings import Settings, cpu_map, load_settings
from services.stage_secret import create_secret_file

log = logging.getLogger("cdb.launcher")

# --- the process tree -----------------------------------------------------------------------------------------


PARENT_ENV = "CDB_PARENT_PID"
SECRET_ENV = "CDB_STAGE_SECRET_FILE"
MAX_RESTARTS = 10
RESTART_WINDOW_S = 60.0
_SUPERVISE_PERIOD_S = 0.1


def pin_cpus(role: str, settings: Settings | None = None) -> None:
    """Pin this process (``role`` of the tree) to the CPUs ``CDB_CPUS`` gives it, if any: on a small host the
    loop stage can then own a core instead of time-sharing it with the head, prelude and scheduler."""
    cpus = cpu_map((settings or load_settings()).cpus).get(role)
    if cpus:
        os.sched_setaffinity(0, cpus)


def die_with_parent() -> None:
    """In a child of the tree (``cdb stage`` / ``cdb scheduler``): get SIGTERM when the launcher dies.

    Set by the child itself at start (``PR_SET_PDEATHSIG``), not between fork and exec: running Python code there
    breaks gRPC's fork handlers when the launching process uses gRPC itself. A launcher already gone by then
    (the parent is no longer the one recorded in ``CDB_PARENT_PID``) ends the child at once."""
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


class ServeHandle:
    """The running tree. ``stop()`` ends it: scheduler first (it drains), then the stages."""

    def __init__(self, workdir: str, settings: Settings) -> None:
        self.workdir = workdir
        self.settings = settings
        self.address = ""
        self.stage_addrs: dict[Stage, str] = {}
        self.stages: dict[Stage, subprocess.Popen[bytes]] = {}
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.restarts: list[tuple[str, float]] = []  # (child name, time.monotonic()) of every restart
        self.failed: str | None = None  # why supervision gave up (the tree is then stopped)
        self._argv: dict[str, tuple[list[str], Mapping[str, str] | None]] = {}  # child name -> how to start it
        self._stopped = False
        self._gone = threading.Event()  # stop() was called: the supervisor ends
        self._supervisor: threading.Thread | None = None

    def _spawn(self, argv: list[str], name: str, env: Mapping[str, str] | None) -> subprocess.Popen[bytes]:
        self._argv[name] = (argv, env)
        out = open(os.path.join(self.workdir, f"{name}.log"), "ab")  # noqa: SIM115 - the child keeps it
        cmd = [sys.executable, *argv]
        child_env = dict(os.environ if env is None else env)
        child_env[PARENT_ENV] = str(os.getpid())
        if self.settings.stage_secret_file:
            child_env[SECRET_ENV] = self.settings.stage_secret_file
        # A session of its own: a terminal's Ctrl-C reaches the launcher only, which stops the children in order.
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=child_env)

    def supervise(self) -> None:
        """Restart children that die from now on (a thread; ``stop`` ends it)."""
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name="cdb-supervisor", daemon=True)
            self._supervisor.start()

    def _supervise(self) -> None:
        while not self._gone.wait(_SUPERVISE_PERIOD_S):  # a watch period over the children, not a synchronisation
            children: dict[str, subprocess.Popen[bytes] | None] = {s.role: p for s, p in self.stages.items()}
            children["scheduler"] = self.scheduler
            for name, proc in children.items():
                if proc is None or proc.poll() is None or self._gone.is_set():
                    continue
                now = time.monotonic()
                recent = [t for n, t in self.restarts if n == name and now - t < RESTART_WINDOW_S]
                if len(recent) >= MAX_RESTARTS:
                    self.failed = f"{name} exited with code {proc.returncode} {len(recent) + 1} times in a minute"
                    log.error("cdb: %s; giving up", self.failed)
                    self._gone.set()
                    return
                log.warning("cdb: %s exited with code %s; restarting it", name, proc.returncode)
                argv, env = self._argv[name]
                if name == "scheduler" and _any_port(argv):
                    self.failed = f"the scheduler exited with code {proc.returncode} (its port was chosen at random)"
                    log.error("cdb: %s; stopping", self.failed)
                    self._gone.set()
                    return
                new = self._spawn(argv, name, env)
                self.restarts.append((name, now))
                if name == "scheduler":
                    self.scheduler = new
                else:
                    self.stages[Stage.from_role(name)] = new

    def unsupervise(self) -> None:
        """Stop restarting children (an operator who restarts them by other means; tests of a stage that stays
        down). ``stop`` still ends them all."""
        self._gone.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)

    @property
    def given_up(self) -> bool:
        return self.failed is not None

    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in (self.scheduler, *self.stages.values()) if p is not None]

    def log(self, name: str) -> str:
        """A child's output so far (``scheduler`` or a role name); for error messages and tests."""
        path = os.path.join(self.workdir, f"{name}.log")
        return Path(path).read_text(errors="replace") if os.path.exists(path) else ""

    def stop(self, drain_timeout: float | None = None) -> None:
        """SIGTERM the scheduler and wait for its drain, then the stages; SIGKILL what does not exit."""
        if self._stopped:
            return
        self._stopped = True
        self._gone.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)
        drain = self.settings.drain_timeout_s if drain_timeout is None else drain_timeout
        if self.scheduler is not None:
            _terminate([self.scheduler], drain + 10.0)
        _terminate(list(self.stages.values()), 10.0)
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


def serve_all(
    config: EngineConfig,
    listen: str = "127.0.0.1:50051",
    *,
    settings: Settings | None = None,
    env: Mapping[str, str] | None = None,
    metrics_listen: str | None = None,
) -> ServeHandle:
    """Start three stage servers and the scheduler service; return once all are ready. ``metrics_listen``: the
    scheduler's ``--metrics-listen`` (None: it reads ``CDB_METRICS_ADDR`` from its environment)."""
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
    settings = settings or load_settings()
    workdir = tempfile.mkdtemp(prefix="cdb-serve-")
    if not (settings.stage_secret_file or settings.stage_secret):
        secret_file = os.path.join(workdir, "stage.secret")
        create_secret_file(secret_file)
        settings = dataclasses.replace(settings, stage_secret_file=secret_file)
    handle = ServeHandle(workdir, settings)
    try:
        # Unix socket paths are known in advance, so the scheduler starts with the stages and connects as soon
        # as they listen (it waits for them): start-up costs one interpreter + torch import, not two.
        ready = {stage: os.path.join(handle.workdir, f"{stage.role}.ready") for stage in Stage}
        sockets = {stage: f"unix://{handle.workdir}/{stage.role}.sock" for stage in Stage}
        for stage in Stage:
            argv = ["-m", "cdb", "stage", "--role", stage.role, "--model", config.model, "--listen", sockets[stage]]
            argv += ["--dtype", config.dtype, "--device", config.device, "--ready-file", ready[stage]]
            if config.synthetic_cost:
                argv += ["--synthetic-cost", config.synthetic_cost, "--synthetic-depths", config.synthetic_depths]
            handle.stages[stage] = handle._spawn(argv, stage.role, env)
        sched_ready = os.path.join(handle.workdir, "scheduler.ready")
        if listen is not None:
            argv = ["-m", "cdb", "scheduler", "--listen", listen, "--ready-file", sched_ready]
            argv += [f"--stage={s.role}={a}" for s, a in sockets.items()]
            if metrics_listen is not None:
                argv.append(f"--metrics-listen={metrics_listen}")
            argv += engine_config_to_argv(config, env)
            handle.scheduler = handle._spawn(argv, "scheduler", env)
        for stage in Stage:
            proc = handle.stages[stage]
            timeout = settings.ready_timeout_s
            handle.stage_addrs[stage] = wait_ready_file(ready[stage], proc, timeout, f"{stage.role} stage")
        if handle.scheduler is not None:
            handle.address = wait_ready_file(sched_ready, handle.scheduler, settings.ready_timeout_s, "scheduler")
        handle.supervise()
    except BaseException as exc:
        logs = "\n".join(f"--- {n}.log ---\n{handle.log(n)[-2000:]}" for n in ("scheduler", *Stage.roles()))
        handle.stop(drain_timeout=0.0)
        if isinstance(exc, RuntimeError):
            raise RuntimeError(f"{exc}\n{logs}") from exc
        raise
    return handle


def serve_forever(
    config: EngineConfig, listen: str = "127.0.0.1:50051", metrics_listen: str | None = None, http: str | None = None
) -> int:
    """Run the tree in the foreground until Ctrl-C / SIGTERM (exit 0), or until the supervisor gives up on a child
    that keeps dying (exit 1). ``http``: the address the scheduler serves the HTTP API on (for the banner; the
    scheduler reads ``CDB_HTTP_ADDR``)."""
    try:
        handle = serve_all(config, listen, metrics_listen=metrics_listen)
    except RuntimeError as exc:  # a child failed to start: its log tail follows the first line
        print(f"cdb serve: {exc}", file=sys.stderr)
        return 1
    limits = resolve_limits(config, load_config(config.model))
    print(f"cdb serving {config.model} on {handle.address} (stages: prelude, loop, head)", flush=True)
    print(f"  {describe(limits)}", flush=True)
    if config.synthetic_cost:
        print(f"  SYNTHETIC stages: modelled device time {config.synthetic_cost}; tokens mean nothing", flush=True)
    if http:
        print(f"OpenAI-compatible HTTP API on http://{http}/v1", flush=True)
    if metrics_listen:
        print(f"Prometheus metrics on http://{metrics_listen}/metrics", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):  # also watch the supervisor's verdict
        if handle.given_up:
            print(f"cdb: {handle.failed}; stopping", file=sys.stderr)
            break
    handle.stop()
    return 1 if handle.given_up else 0
