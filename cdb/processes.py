"""``cdb stage``, ``cdb scheduler`` and ``cdb frontend``: one process of the tree each (the launcher's and compose's
commands), and ``cdb secret``; each resolves its configuration once (``cdb.resolution``)."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Mapping

from cdb.arguments import add_config_arg, add_log_args, add_public_api_args, new_parser
from cdb.resolution import parse_command, resolve_command
from cdb_engine.options import add_engine_args
from cdb_scheduler.plan import Stage
from services.launcher.child import die_with_parent, pin_cpus, raise_open_files
from services.net import ListenError, parse_stage_addrs
from services.settings.resolved import Resolved
from services.settings.source import Configuration
from services.telemetry.logs import configure_logging

# The engine flags of ``cdb stage``: what a stage loads (its other fields come from its source, and what it serves
# with from the scheduler's Configure)
STAGE_ENGINE_FIELDS = ("model", "dtype", "device", "synthetic_cost", "synthetic_depths")


def process_resolution(command: str, argv: list[str], environ: Mapping[str, str]) -> Resolved:
    """The configuration that ``cdb stage ARGV`` or ``cdb scheduler ARGV`` runs with in ``environ``, without
    running it."""
    build = {"stage": stage_parser, "scheduler": scheduler_parser, "frontend": frontend_parser}[command]
    return resolve_command(argv, f"cdb {command}", build, environ).resolved


def stage_parser(conf: Configuration) -> argparse.ArgumentParser:
    parser = new_parser("cdb stage", stage_main.__doc__)
    parser.add_argument("--role", required=True, choices=Stage.roles(), help="the stage this process serves")
    parser.add_argument("--listen", required=True, help="unix:PATH or a loopback HOST:PORT (port 0: any)")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    add_config_arg(parser)
    add_log_args(parser, conf, requests=False)
    add_engine_args(parser, conf.engine, only=STAGE_ENGINE_FIELDS)
    return parser


def stage_main(argv: list[str] | None = None) -> int:
    """``cdb stage``: serve one stage of a looped LM (``cdb.v1.Stage``) until SIGTERM/SIGINT."""
    from services.transport.stage_server import run_stage

    die_with_parent()
    raise_open_files()
    command = parse_command(argv, "cdb stage", stage_parser)
    if command is None:
        return 2
    resolved, args = command.resolved, command.args
    config, settings = resolved.engine, resolved.settings  # the dtype's auto resolved on the device
    pin_cpus(args.role, settings)
    configure_logging(args.role, settings)
    try:
        run_stage(
            args.role,
            config.model,
            args.listen,
            dtype=config.dtype,
            device=config.device,
            ready_file=args.ready_file,
            settings=settings,
            synthetic_cost=config.synthetic_cost,
            synthetic_depths=config.synthetic_depths,
            config_digest=resolved.digest(),
        )
    except ListenError as exc:
        print(f"{command.parser.prog}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a bad option or setting, e.g. no stage secret: one line
        print(f"{command.parser.prog}: {exc}", file=sys.stderr)
        return 2
    return 0


def secret_main(argv: list[str] | None = None) -> int:
    """``cdb secret --out FILE [--link-out LINK]``: write a fresh random stage-plane secret to FILE (mode 0600)
    unless it exists; every process but the front ends reads it through ``CDB_STAGE_SECRET_FILE``. With
    ``--link-out``, also the front-end link's secret derived from it (the front ends' ``CDB_LINK_SECRET_FILE``: it
    does not reveal the stage secret). Prints no secret."""
    from services.settings import Settings, SettingsError
    from services.stage_secret import create_secret_file, link_secret, load_stage_secret, write_secret_file

    parser = new_parser("cdb secret", secret_main.__doc__)
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the secret (kept if present)")
    parser.add_argument("--link-out", metavar="FILE", help="where to write the front ends' link secret (replaced)")
    args = parser.parse_args(argv)
    try:
        made = create_secret_file(args.out)
        if args.link_out:
            write_secret_file(args.link_out, link_secret(load_stage_secret(Settings(stage_secret_file=args.out))))
    except (OSError, SettingsError) as exc:
        print(f"cdb secret: cannot write the secrets: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    print(f"cdb secret: {'created' if made else 'kept the existing'} {args.out}")
    if args.link_out:
        print(f"cdb secret: wrote the front-end link's secret to {args.link_out}")
    return 0


def scheduler_parser(conf: Configuration) -> argparse.ArgumentParser:
    parser = new_parser("cdb scheduler", scheduler_main.__doc__)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0: any) or unix:PATH")
    parser.add_argument(
        "--stage",
        action="append",
        default=[],
        metavar="ROLE=ADDR",
        help="a stage's address, once per role: prelude, loop and head",
    )
    parser.add_argument(
        "--standby-stage",
        action="append",
        default=[],
        metavar="ROLE=ADDR",
        help="a warm standby stage of a role (model loaded, idle): it takes over when that role's stage is lost",
    )
    parser.add_argument("--in-process", action="store_true", help="run the stages in this process instead")
    parser.add_argument(
        "--link",
        metavar="unix:PATH",
        help="serve the front-end link here: front-end processes (cdb frontend) serve the public ports; "
        "this process then serves no HTTP API",
    )
    parser.add_argument("--ready-file", help="write the bound address here once ready")
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: $CDB_METRICS_ADDR; unset or empty: none)",
    )
    add_public_api_args(parser, conf)
    return parser


def scheduler_main(argv: list[str] | None = None) -> int:
    """``cdb scheduler``: serve ``cdb.v1.Generation`` over stage servers until SIGTERM/SIGINT, then drain."""
    from cdb_engine.preflight import check_config
    from services.api.security import PortSecurity
    from services.api.server import run_scheduler
    from services.frontlink.wire import socket_path
    from services.http import serve_api
    from services.net import check_can_listen
    from services.transport.segments import SharedMemoryFull, sweep_stale_segments

    die_with_parent()
    raise_open_files()
    command = parse_command(argv, "cdb scheduler", scheduler_parser)
    if command is None:
        return 2
    parser, args = command.parser, command.args
    config, settings = command.resolved.engine, command.resolved.settings
    pin_cpus("scheduler", settings)
    configure_logging("scheduler", settings)
    http = None if args.link else settings.http_addr  # with a link, the front ends serve HTTP
    try:
        if args.link:
            socket_path(args.link)
        stage_addrs = None if args.in_process else parse_stage_addrs(args.stage)
        standby_addrs = parse_stage_addrs(args.standby_stage, "--standby-stage", complete=False)
        PortSecurity.from_settings(settings)  # TLS files and API keys, checked before the model loads
        config = check_config(config)  # a bad model path, preset, device, memory: one line before anything loads
    except ValueError as exc:
        parser.error(str(exc))
    try:
        check_can_listen(args.listen)  # before the model loads; serve() raises the same if it loses a race
        if http:
            check_can_listen(http)
        sweep_stale_segments()  # the banks of schedulers that died with their resource tracker (this one makes more)
        run_scheduler(
            config,
            args.listen,
            stage_addrs,
            ready_file=args.ready_file,
            settings=settings,
            companion=functools.partial(serve_api, address=http) if http else None,
            standby_addrs=standby_addrs,
            link=socket_path(args.link) if args.link else None,
        )
    except (ListenError, SharedMemoryFull) as exc:  # a port taken, /dev/shm too small: one line, not a traceback
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    return 0


def frontend_parser(conf: Configuration) -> argparse.ArgumentParser:
    parser = new_parser("cdb frontend", frontend_main.__doc__)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0: any) or unix:PATH")
    parser.add_argument("--link", required=True, metavar="unix:PATH", help="the scheduler's front-end link")
    parser.add_argument(
        "--join", action="store_true", help="another front end serves these ports already: share them, no probe"
    )
    parser.add_argument("--ready-file", help="write the bound address here once ready")
    add_public_api_args(parser, conf)
    return parser


def frontend_main(argv: list[str] | None = None) -> int:
    """``cdb frontend``: serve the public ports (``cdb.v1.Generation``, the HTTP API) over the engine of a
    ``cdb scheduler --link`` until SIGTERM/SIGINT, then drain (``CDB_FRONTENDS``)."""
    from services.api.security import PortSecurity
    from services.frontend.server import run_frontend
    from services.frontlink.wire import socket_path
    from services.net import check_can_listen
    from services.stage_secret import load_link_secret

    die_with_parent()
    raise_open_files()
    command = parse_command(argv, "cdb frontend", frontend_parser)
    if command is None:
        return 2
    parser, args = command.parser, command.args
    config, settings = command.resolved.engine, command.resolved.settings
    pin_cpus("frontend", settings)
    configure_logging("frontend", settings)
    http = settings.http_addr
    try:
        socket_path(args.link)
        PortSecurity.from_settings(settings)
        load_link_secret(settings)  # (absent: one line, before the model's tokenizer loads)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        if not args.join:
            check_can_listen(args.listen)
            if http:
                check_can_listen(http)
        run_frontend(config, args.listen, args.link, settings, ready_file=args.ready_file, http=http, join=args.join)
    except ListenError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    return 0
