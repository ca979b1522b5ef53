"""Starting the tree: the stages, the scheduler and the front ends as children of a ``ServeHandle``, each with
the tree's configuration document, then waiting until each one is ready (its ready file; failing fast if it
exits first)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping

from cdb_engine.config import EngineConfig
from cdb_engine.memory import sized
from cdb_scheduler.plan import Stage
from services.launcher.commands import (
    FRONTEND_PREFIX,
    STANDBY_SUFFIX,
    frontend_command,
    scheduler_command,
    stage_command,
)
from services.launcher.supervisor import Process, ServeHandle
from services.net import wait_ready_file
from services.settings.knobs import Settings
from services.settings.resolved import Resolved
from services.settings.source import load_settings
from services.stage_secret import create_secret_file, link_secret, load_stage_secret, write_secret_file
from services.transport.segments import sweep_stale_segments


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
    config = sized(config)  # once, here: every child reads the same KV pool size
    if metrics_listen is not None:
        settings = dataclasses.replace(settings, metrics_addr=metrics_listen)
    sweep_stale_segments()  # what trees SIGKILLed whole left behind (their owners are gone)
    workdir = tempfile.mkdtemp(prefix="cdb-serve-")
    if settings.log_dir:
        os.makedirs(settings.log_dir, exist_ok=True)
    if not (settings.stage_secret_file or settings.stage_secret):
        secret_file = os.path.join(workdir, "stage.secret")
        create_secret_file(secret_file)
        settings = dataclasses.replace(settings, stage_secret_file=secret_file)
    on_device = config.device.startswith("cuda") or bool(config.synthetic_cost)
    fronts = settings.front_ends(on_device) if listen is not None else 0
    settings = dataclasses.replace(settings, frontends=fronts)  # (the children read the count, not auto)
    document = os.path.join(workdir, "config.json")
    Resolved(settings, config).write(document)  # what every child runs with (package docstring)
    fronts_document = _front_end_document(workdir, settings, config) if fronts else document
    handle = ServeHandle(workdir, settings)
    try:
        _start_children(handle, listen, fronts, document, fronts_document, env)
        _wait_until_ready(handle, fronts, fronts_document, env)
        handle.supervise()
    except BaseException as exc:
        logs = _failed_logs(handle, ("scheduler", *Stage.roles(), *(f"{FRONTEND_PREFIX}{i}" for i in range(fronts))))
        handle.stop(drain_timeout=0.0)
        if isinstance(exc, RuntimeError):
            raise RuntimeError(f"{exc}\n{logs}") from exc
        raise
    return handle


_STAGE_SECRET_VARIABLES = frozenset({"CDB_STAGE_SECRET", "CDB_STAGE_SECRET_FILE"})  # not in a front end's environment


def _front_end_document(workdir: str, settings: Settings, config: EngineConfig) -> str:
    """What the front ends run with: the tree's configuration with the front-end link's secret in place of the stage
    secret (``services.stage_secret``: a front end taken over controls no stage)."""
    secret = os.path.join(workdir, "link.secret")
    write_secret_file(secret, link_secret(load_stage_secret(settings)))
    document = os.path.join(workdir, "frontend-config.json")
    own = dataclasses.replace(settings, stage_secret="", stage_secret_file="", link_secret_file=secret)
    Resolved(own, config).write(document)
    return document


def _failed_logs(handle: ServeHandle, names: tuple[str, ...], lines: int = 20) -> str:
    """The last ``lines`` lines of the children that exited (of every child named when none has)."""
    failed = [n for n in names if handle.exited(n)] or list(names)
    tails = ("\n".join(handle.log(n).splitlines()[-lines:]) for n in failed)
    return "\n".join(f"--- {n} (last lines of {handle.log_path(n)}) ---\n{tail}" for n, tail in zip(failed, tails))


def _ready_file(handle: ServeHandle, name: str) -> str:
    """Where the child ``name`` announces its address once it serves."""
    return os.path.join(handle.workdir, f"{name}.ready")


def _link(handle: ServeHandle) -> str:
    """The scheduler's front-end link (``CDB_FRONTENDS``)."""
    return f"unix:{handle.workdir}/link.sock"


def _start_children(
    handle: ServeHandle,
    listen: str | None,
    fronts: int,
    document: str,
    fronts_document: str,
    env: Mapping[str, str] | None,
) -> None:
    """Start the stages (and their standbys), then, with a ``listen`` address, the scheduler and the first of
    ``fronts`` front ends; wait for none of them."""
    # Unix socket paths are known in advance, so the scheduler starts with the stages and connects as soon as they
    # listen (it waits for them): start-up costs one interpreter + torch import, not two.
    names = {stage: stage.role for stage in Stage}
    standby = {stage: stage.role + STANDBY_SUFFIX for stage in Stage} if handle.settings.standby_stages else {}
    sockets = {n: f"unix://{handle.workdir}/{n}.sock" for n in (*names.values(), *standby.values())}
    for stage, name in [*names.items(), *standby.items()]:
        ready = _ready_file(handle, name)
        handle.start_child(name, stage_command(stage.role, sockets[name], ready, document), env, ready)
    if listen is None:
        return
    stage_socks = {s: sockets[n] for s, n in names.items()}
    standby_socks = {s: sockets[n] for s, n in standby.items()}
    # with front ends the scheduler's own gRPC port is private; the front ends take ``listen``
    inner = f"unix://{handle.workdir}/scheduler.sock" if fronts else listen
    sched_ready = _ready_file(handle, "scheduler")
    argv = scheduler_command(inner, sched_ready, stage_socks, standby_socks, document)
    if fronts:
        argv.append(f"--link={_link(handle)}")
    handle.start_child("scheduler", argv, env, sched_ready)
    if fronts:  # the first front end starts beside the scheduler (it connects once the link listens)
        _spawn_frontend(handle, 0, listen, _link(handle), fronts_document, env, join=False)


def _wait_until_ready(handle: ServeHandle, fronts: int, document: str, env: Mapping[str, str] | None) -> None:
    """Wait for each child's ready file (the stages', the standbys', the scheduler's), noting the addresses, then
    start the other front ends on the first one's port."""
    timeout = handle.settings.ready_timeout_s
    for stage, proc in handle.stages.items():
        handle.stage_addrs[stage] = wait_ready_file(
            _ready_file(handle, stage.role), proc, timeout, f"{stage.role} stage"
        )
    for stage, proc in handle.standbys.items():
        ready, what = _ready_file(handle, stage.role + STANDBY_SUFFIX), f"{stage.role} standby stage"
        handle.standby_addrs[stage] = wait_ready_file(ready, proc, timeout, what)
    if handle.scheduler is not None:
        handle.address = wait_ready_file(_ready_file(handle, "scheduler"), handle.scheduler, timeout, "scheduler")
    if fronts:
        handle.address = _start_frontends(handle, fronts, _link(handle), document, env)


def _frontend_ready(handle: ServeHandle, i: int) -> str:
    return _ready_file(handle, f"{FRONTEND_PREFIX}{i}")


def _spawn_frontend(
    handle: ServeHandle, i: int, listen: str, link: str, document: str, env: Mapping[str, str] | None, join: bool
) -> Process:
    ready = _frontend_ready(handle, i)
    argv = frontend_command(listen, ready, link, document, join)
    own = {k: v for k, v in (os.environ if env is None else env).items() if k not in _STAGE_SECRET_VARIABLES}
    return handle.start_child(f"{FRONTEND_PREFIX}{i}", argv, own, ready)


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
