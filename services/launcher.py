"""Start the process tree on this machine: three stage servers, then the scheduler service.

API for ``cdb serve`` (argparse-free):

- ``serve_all(config, listen) -> ServeHandle``: starts the stages (Unix sockets in a private temp dir) and the
  scheduler as child processes, waits until each one is ready, returns a handle (``address``, ``stop()``).
- ``serve_main(config, listen) -> int``: ``serve_all``, print the address, block until Ctrl-C / SIGTERM or a
  child's death, stop every child (scheduler first, so it drains; then the stages).
- ``run_stage(...)`` / ``run_scheduler(...)``: run one process in the current one (docker-compose entrypoints
  are ``python -m services.stage_server`` and ``python -m services.scheduler_server``).

Readiness: each child writes its bound address to a ready file (atomic rename) once it serves (the scheduler:
once its health is SERVING); the launcher waits for those files and fails fast if a child exits first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from cdb_engine.config import EngineConfig
from cdb_scheduler.plan import Stage
from services.settings import Settings, is_host_port, load_settings

ROLE_NAMES = {Stage.PRELUDE: "prelude", Stage.LOOP: "loop", Stage.HEAD: "head"}


def write_ready_file(path: str, address: str) -> None:
    """Publish ``address`` atomically (readers never see a partial file)."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(address)
    os.replace(tmp, path)


def wait_ready_file(path: str, proc: subprocess.Popen[Any], timeout: float, what: str) -> str:
    """The address ``proc`` publishes in ``path``; raises RuntimeError if it exits or times out first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Path(path).read_text()
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f}s")
        time.sleep(0.02)  # polling a file for a child's readiness


# --- engine configuration <-> command-line options ------------------------------------------------------------


def _field_kind(f: dataclasses.Field[Any]) -> type | None:
    t = str(f.type)
    for kind in (bool, int, float, str):
        if kind.__name__ in t:
            return kind
    return None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--option`` per ``EngineConfig`` field (``max_num_seqs`` -> ``--max-num-seqs``)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        kind = _field_kind(f)
        if kind is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            group.add_argument(flag, type=kind, default=None, metavar=kind.__name__.upper())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """``EngineConfig`` from ``add_engine_args`` options (unset options keep the defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if getattr(args, f.name, None) is not None}  # fmt: skip
    return EngineConfig(**values)


def engine_config_to_argv(config: EngineConfig) -> list[str]:
    """The options that reproduce ``config`` (fields equal to the default are left out)."""
    default = EngineConfig()
    argv: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value == getattr(default, f.name) or value is None or _field_kind(f) is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv


def parse_stage_addrs(specs: Sequence[str]) -> dict[Stage, str]:
    """``["prelude=ADDR", "loop=ADDR", "head=ADDR"]`` -> addresses by stage; all three required."""
    by_name = {name: stage for stage, name in ROLE_NAMES.items()}
    addrs: dict[Stage, str] = {}
    for spec in specs:
        role, sep, address = spec.partition("=")
        if not sep or role not in by_name or not address:
            raise ValueError(f"--stage must be ROLE=ADDRESS with ROLE in prelude|loop|head, got {spec!r}")
        addrs[by_name[role]] = address
    missing = [ROLE_NAMES[s] for s in Stage if s not in addrs]
    if missing:
        raise ValueError(f"missing --stage for {', '.join(missing)} (or use --in-process)")
    return addrs


# --- running one process here ---------------------------------------------------------------------------------


def run_stage(role: str, model: str, listen: str, **kwargs: Any) -> None:
    """Serve one stage in this process until SIGTERM/SIGINT (see ``services.stage_server.run_stage``)."""
    from services import stage_server

    stage_server.run_stage(role, model, listen, **kwargs)


def run_scheduler(config: EngineConfig, listen: str, stage_addrs: Mapping[Stage, str] | None, **kwargs: Any) -> None:
    """Serve the public API in this process until SIGTERM/SIGINT (see ``services.scheduler_server``)."""
    from services import scheduler_server

    scheduler_server.run_scheduler(config, listen, stage_addrs, **kwargs)


# --- the process tree -----------------------------------------------------------------------------------------


def _child_setup() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()  # a terminal's Ctrl-C reaches the launcher only, which stops the children in order
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with us
    except OSError:
        pass


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
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_child_setup,
                                env=dict(env) if env is not None else None)  # fmt: skip

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


def serve_all(config: EngineConfig, listen: str = "127.0.0.1:50051", *, settings: Settings | None = None,
              env: Mapping[str, str] | None = None, metrics_listen: str | None = None) -> ServeHandle:  # fmt: skip
    """Start three stage servers and the scheduler service; return once all are ready. ``metrics_listen``: the
    scheduler's ``--metrics-listen`` (None: it reads ``CDB_METRICS_ADDR`` from its environment)."""
    return _start_tree(config, listen, settings, env, metrics_listen)


def start_stages(config: EngineConfig, *, settings: Settings | None = None,
                 env: Mapping[str, str] | None = None) -> ServeHandle:  # fmt: skip
    """Start only the three stage servers (``handle.stage_addrs``), e.g. for an in-process ``Engine`` over
    ``GrpcExecutorFactory`` (benchmarks); return once all are ready."""
    return _start_tree(config, None, settings, env)


def _start_tree(config: EngineConfig, listen: str | None, settings: Settings | None,
                env: Mapping[str, str] | None, metrics_listen: str | None = None) -> ServeHandle:  # fmt: skip
    settings = settings or load_settings()
    handle = ServeHandle(tempfile.mkdtemp(prefix="cdb-serve-"), settings)
    try:
        # Unix socket paths are known in advance, so the scheduler starts with the stages and connects as soon
        # as they listen (it waits for them): start-up costs one interpreter + torch import, not two.
        ready = {stage: os.path.join(handle.workdir, f"{role}.ready") for stage, role in ROLE_NAMES.items()}
        sockets = {stage: f"unix://{handle.workdir}/{role}.sock" for stage, role in ROLE_NAMES.items()}
        for stage, role in ROLE_NAMES.items():
            argv = ["-m", "services.stage_server", "--role", role, "--model", config.model,
                    "--listen", sockets[stage], "--dtype", config.dtype, "--device", config.device,
                    "--ready-file", ready[stage]]  # fmt: skip
            handle.stages[stage] = handle._spawn(argv, f"{role}.log", env)
        sched_ready = os.path.join(handle.workdir, "scheduler.ready")
        if listen is not None:
            argv = ["-m", "services.scheduler_server", "--listen", listen, "--ready-file", sched_ready]
            argv += [f"--stage={ROLE_NAMES[s]}={a}" for s, a in sockets.items()]
            if metrics_listen is not None:
                argv.append(f"--metrics-listen={metrics_listen}")
            argv += engine_config_to_argv(config)
            handle.scheduler = handle._spawn(argv, "scheduler.log", env)
        for stage, role in ROLE_NAMES.items():
            proc = handle.stages[stage]
            handle.stage_addrs[stage] = wait_ready_file(ready[stage], proc, settings.ready_timeout_s, f"{role} stage")
        if handle.scheduler is not None:
            handle.address = wait_ready_file(sched_ready, handle.scheduler, settings.ready_timeout_s, "scheduler")
    except BaseException as exc:
        logs = "\n".join(f"--- {n}.log ---\n{handle.log(n)[-2000:]}" for n in ("scheduler", *ROLE_NAMES.values()))
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


def _serve_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="public address, HOST:PORT (port 0: any)")
    add_engine_args(parser)
    return parser


def _add_metrics_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-listen", metavar="HOST:PORT", default=load_settings().metrics_addr,
                        help="the scheduler's Prometheus endpoint, http://HOST:PORT/metrics (default: "
                        "$CDB_METRICS_ADDR; empty: none)")  # fmt: skip


def serve_main(argv: list[str] | None = None) -> int:
    """``cdb serve``: the scheduler and the three stages on this machine, until Ctrl-C / SIGTERM."""
    parser = _serve_parser("cdb serve", serve_main.__doc__ or "")
    _add_metrics_arg(parser)
    args = parser.parse_args(argv)
    try:
        config = engine_config_from_args(args)
        if args.metrics_listen and not is_host_port(args.metrics_listen):
            raise ValueError(f"--metrics-listen must be HOST:PORT, got {args.metrics_listen!r}")
    except ValueError as exc:
        parser.error(str(exc))
    return serve_forever(config, args.listen, args.metrics_listen)


def demo_main(argv: list[str] | None = None) -> int:
    """``cdb demo``: serve the embedded default, stream one generation (with depths), stop."""
    from clients.common import StreamToken
    from clients.sync_client import Client

    parser = _serve_parser("cdb demo", demo_main.__doc__ or "")
    parser.set_defaults(listen="127.0.0.1:0")
    parser.add_argument("--prompt", default="Looped models think deeper on harder tokens.")
    parser.add_argument("--max-tokens", dest="demo_max_tokens", type=int, default=32)
    parser.add_argument("--temperature", dest="demo_temperature", type=float, default=0.8)
    parser.add_argument("--seed", dest="demo_seed", type=int, default=7)
    args = parser.parse_args(argv)
    config = engine_config_from_args(args)
    print(f"starting the prelude, loop and head stages and the scheduler for {config.model} ...", flush=True)
    with serve_all(config, args.listen) as handle, Client(handle.address) as client:
        print(f"serving on {handle.address}; streaming one generation (token[served loop depth]; a tiny random "
              "model: the text is noise, the depths are real):", flush=True)  # fmt: skip
        options = {"max_tokens": args.demo_max_tokens, "temperature": args.demo_temperature, "seed": args.demo_seed}
        for item in client.stream(args.prompt, ignore_eos=True, **options):
            if isinstance(item, StreamToken):
                print(f"{item.text or f'<{item.id}>'}[{item.depth}]", end=" ", flush=True)
            else:
                print(f"\nfinish: {item.finish_reason}, {item.generated_tokens} tokens, {item.total_loop_steps} steps")
    return 0
