"""The process tree on this machine: three stage servers, then the scheduler service, as child processes.

- ``serve_all(config, listen) -> ServeHandle``: starts the stages (Unix sockets in a private temp dir) and the
  scheduler (``cdb stage`` / ``cdb scheduler``), waits until each one is ready, returns a handle (``address``,
  ``stop()``).
- ``start_stages(config)``: only the three stages (benchmarks drive them from an in-process engine).
- ``serve_forever(config, listen)``: ``serve_all``, then supervise until Ctrl-C / SIGTERM or a child's death,
  and stop every child (scheduler first, so it drains; then the stages).

Readiness: each child writes its bound address to a ready file (``services.net.write_ready_file``) once it
serves (the scheduler: once its health is SERVING); the launcher waits for those files and fails fast if a
child exits first.
"""

from __future__ import annotations

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
from cdb_engine.options import engine_config_to_argv
from cdb_scheduler.plan import Stage
from services.net import wait_ready_file
from services.settings import Settings, cpu_map, load_settings

# --- the process tree -----------------------------------------------------------------------------------------


PARENT_ENV = "CDB_PARENT_PID"


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
        self._stopped = False

    def _spawn(self, argv: list[str], log_name: str, env: Mapping[str, str] | None) -> subprocess.Popen[bytes]:
        log = open(os.path.join(self.workdir, log_name), "wb")  # noqa: SIM115 - the child keeps it
        cmd = [sys.executable, *argv]
        child_env = dict(os.environ if env is None else env)
        child_env[PARENT_ENV] = str(os.getpid())
        # A session of its own: a terminal's Ctrl-C reaches the launcher only, which stops the children in order.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=child_env)

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
        drain = self.settings.drain_timeout_s if drain_timeout is None else drain_timeout
        if self.scheduler is not None:
            _terminate([self.scheduler], drain + 10.0)
        _terminate(list(self.stages.values()), 10.0)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ServeHandle:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


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
    handle = ServeHandle(tempfile.mkdtemp(prefix="cdb-serve-"), settings)
    try:
        # Unix socket paths are known in advance, so the scheduler starts with the stages and connects as soon
        # as they listen (it waits for them): start-up costs one interpreter + torch import, not two.
        ready = {stage: os.path.join(handle.workdir, f"{stage.role}.ready") for stage in Stage}
        sockets = {stage: f"unix://{handle.workdir}/{stage.role}.sock" for stage in Stage}
        for stage in Stage:
            argv = ["-m", "cdb", "stage", "--role", stage.role, "--model", config.model, "--listen", sockets[stage]]
            argv += ["--dtype", config.dtype, "--device", config.device, "--ready-file", ready[stage]]
            handle.stages[stage] = handle._spawn(argv, f"{stage.role}.log", env)
        sched_ready = os.path.join(handle.workdir, "scheduler.ready")
        if listen is not None:
            argv = ["-m", "cdb", "scheduler", "--listen", listen, "--ready-file", sched_ready]
            argv += [f"--stage={s.role}={a}" for s, a in sockets.items()]
            if metrics_listen is not None:
                argv.append(f"--metrics-listen={metrics_listen}")
            argv += engine_config_to_argv(config)
            handle.scheduler = handle._spawn(argv, "scheduler.log", env)
        for stage in Stage:
            proc = handle.stages[stage]
            timeout = settings.ready_timeout_s
            handle.stage_addrs[stage] = wait_ready_file(ready[stage], proc, timeout, f"{stage.role} stage")
        if handle.scheduler is not None:
            handle.address = wait_ready_file(sched_ready, handle.scheduler, settings.ready_timeout_s, "scheduler")
    except BaseException as exc:
        logs = "\n".join(f"--- {n}.log ---\n{handle.log(n)[-2000:]}" for n in ("scheduler", *Stage.roles()))
        handle.stop(drain_timeout=0.0)
        if isinstance(exc, RuntimeError):
            raise RuntimeError(f"{exc}\n{logs}") from exc
        raise
    return handle


def serve_forever(config: EngineConfig, listen: str = "127.0.0.1:50051", metrics_listen: str | None = None) -> int:
    """Run the tree in the foreground until Ctrl-C / SIGTERM (exit 0) or a child's death (exit 1)."""
    handle = serve_all(config, listen, metrics_listen=metrics_listen)
    print(f"cdb serving {config.model} on {handle.address} (stages: prelude, loop, head)", flush=True)
    if metrics_listen:
        print(f"Prometheus metrics on http://{metrics_listen}/metrics", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    died = None
    while not stop.wait(0.5):  # also watch the children
        died = next((p for p in handle.processes() if p.poll() is not None), None)
        if died is not None:
            print(f"cdb: child {died.args!r} exited with code {died.returncode}; stopping", file=sys.stderr)
            break
    handle.stop()
    return 1 if died is not None else 0
