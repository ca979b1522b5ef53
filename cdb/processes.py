"""``cdb stage`` and ``cdb scheduler``: one process of the tree each (the launcher's and compose's commands)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Mapping

from cdb.model_source import ModelNotFoundError, ModelSource, resolve_model
from cdb_engine.config import EngineConfig
from cdb_engine.options import add_engine_args, engine_config_from_args
from cdb_scheduler.plan import Stage
from services.launcher import die_with_parent, pin_cpus
from services.net import ListenError, is_host_port, parse_stage_addrs
from services.settings import LOG_LEVELS, Configuration, Settings, SettingsError, load_configuration, served_names
from services.telemetry.logs import configure_logging
from services.version import server_version

STAGE_ENGINE_FIELDS = ("model", "dtype", "device", "synthetic_cost", "synthetic_depths")  # what a stage loads;
# the rest comes with Configure


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default (``unset`` for none); a required option has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or "(default:" in text or not action.option_strings or action.required:
            return text
        if action.default is argparse.SUPPRESS:
            return text
        if action.default in (None, ""):
            return text + " (default: unset)"
        return text + " (default: %(default)s)"


def new_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """A ``cdb`` command's parser: defaults shown in the help, ``--version``."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"cdb {server_version()}")
    return parser


def add_served_name_arg(parser: argparse.ArgumentParser) -> None:
    """``--served-model-name NAME...`` (over ``CDB_SERVED_MODEL_NAME``); read it with ``served_model_names``."""
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the names the HTTP API accepts as 'model', the first reported (default: $CDB_SERVED_MODEL_NAME, "
        "comma-separated; else the model as named)",
    )


def served_model_names(args: argparse.Namespace, settings: Settings, source: ModelSource) -> list[str]:
    """The names the model is served under: ``--served-model-name``, else ``CDB_SERVED_MODEL_NAME``, else the model
    as the user named it (a hub id, not its cache folder); ValueError for an empty name or one with a comma (the
    names travel to the scheduler comma-separated)."""
    given = args.served_model_name or []
    if any(not name.strip() or "," in name for name in given):
        raise ValueError(f"--served-model-name takes names without commas, none empty; got {given!r}")
    return [name.strip() for name in given] or served_names(settings.served_model_name) or [source.name]


def resolve_model_arg(args: argparse.Namespace) -> ModelSource:
    """Resolve ``args.model`` (a hub id: its snapshot in the local Hugging Face cache) and put the path the loader
    reads in its place; ``ModelNotFoundError`` (one line) when a hub id is not in the cache."""
    source = resolve_model(args.model)
    args.model = source.path
    return source


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="config file (TOML; YAML for .yaml/.yml) of settings and engine options, under the CDB_* variables "
        "and these flags; keys as in services/settings.py (default: $CDB_CONFIG)",
    )


def add_log_args(parser: argparse.ArgumentParser, conf: Configuration, *, requests: bool = True) -> None:
    """``--log-level`` (and ``--request-log`` where requests are served), over ``CDB_LOG_LEVEL`` and
    ``CDB_REQUEST_LOG``."""
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=conf.settings.log_level,
        help="log level (also CDB_LOG_LEVEL; CDB_LOG_FORMAT=json: JSON lines)",
    )
    if requests:
        parser.add_argument(
            "--request-log",
            action="store_true",
            default=conf.settings.request_log,
            help="log a line per finished request, never its text (also CDB_REQUEST_LOG)",
        )


def read_configuration(
    argv: list[str] | None, environ: Mapping[str, str] | None = None, *, prog: str = "cdb"
) -> Configuration:
    """The source of a command's defaults: ``environ`` (default: ``os.environ``) and the config file its
    ``--config`` (or ``CDB_CONFIG``) names; SettingsError naming a bad value."""
    pre = argparse.ArgumentParser(prog=prog, add_help=False)
    pre.add_argument("--config", metavar="FILE")
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    return load_configuration(environ, known.config)


def stage_parser(conf: Configuration) -> argparse.ArgumentParser:
    parser = new_parser("cdb stage", stage_main.__doc__)
    parser.add_argument("--role", required=True, choices=Stage.roles(), help="the stage this process serves")
    parser.add_argument("--listen", required=True, help="unix:PATH or a loopback HOST:PORT (port 0: any)")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    add_config_arg(parser)
    add_log_args(parser, conf, requests=False)
    add_engine_args(parser, conf.engine, only=STAGE_ENGINE_FIELDS)
    return parser


def process_config(command: str, argv: list[str], environ: Mapping[str, str]) -> EngineConfig:
    """The engine config that ``cdb stage ARGV`` or ``cdb scheduler ARGV`` runs with in ``environ``, without
    running it (a stage's fields beyond model, dtype and device keep their defaults)."""
    build = {"stage": stage_parser, "scheduler": scheduler_parser}[command]
    return engine_config_from_args(build(read_configuration(argv, environ)).parse_args(argv))


def parse_command(
    argv: list[str] | None, prog: str, build: Callable[[Configuration], argparse.ArgumentParser]
) -> tuple[Configuration, argparse.ArgumentParser, argparse.Namespace] | None:
    """Read the config source, build ``prog``'s parser over it (``build``) and parse ``argv``. A bad setting prints
    one line and gives None (the command exits 2)."""
    try:
        conf = read_configuration(argv, prog=prog)
    except SettingsError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return None
    parser = build(conf)
    return conf, parser, parser.parse_args(argv)


def stage_main(argv: list[str] | None = None) -> int:
    """``cdb stage``: serve one stage of a looped LM (``cdb.v1.Stage``) until SIGTERM/SIGINT."""
    from services.transport.stage_server import run_stage

    die_with_parent()
    parsed = parse_command(argv, "cdb stage", stage_parser)
    if parsed is None:
        return 2
    conf, parser, args = parsed
    try:
        resolve_model_arg(args)
        config = engine_config_from_args(args)  # the dtype's auto resolves on the device, as the scheduler's
    except ModelNotFoundError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        parser.error(str(exc))
    pin_cpus(args.role, conf.settings)
    configure_logging(args.role, conf.settings, args.log_level)
    try:
        run_stage(
            args.role,
            config.model,
            args.listen,
            dtype=config.dtype,
            device=config.device,
            ready_file=args.ready_file,
            settings=conf.settings,
            synthetic_cost=config.synthetic_cost,
            synthetic_depths=config.synthetic_depths,
        )
    except ListenError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a bad option or setting, e.g. no stage secret: one line
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    return 0


def secret_main(argv: list[str] | None = None) -> int:
    """``cdb secret --out FILE``: write a fresh random stage-plane secret to FILE (mode 0600) unless it exists;
    every process of a deployment reads it through ``CDB_STAGE_SECRET_FILE``. Prints no secret."""
    from services.stage_secret import create_secret_file

    parser = new_parser("cdb secret", secret_main.__doc__)
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the secret (kept if present)")
    args = parser.parse_args(argv)
    try:
        made = create_secret_file(args.out)
    except OSError as exc:
        print(f"cdb secret: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"cdb secret: {'created' if made else 'kept the existing'} {args.out}")
    return 0


# public-port flags -> the CDB_* variables they set (docs/operations.md, "Exposing the public port")
PUBLIC_PORT_FLAGS = {
    "tls_cert": "CDB_TLS_CERT",
    "tls_key": "CDB_TLS_KEY",
    "tls_client_ca": "CDB_TLS_CLIENT_CA",
    "api_keys_file": "CDB_API_KEYS_FILE",
}


def add_public_port_args(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert/--tls-key/--tls-client-ca/--api-keys-file`` (each overrides its ``CDB_*`` variable)."""
    group = parser.add_argument_group("public port (TLS, mTLS, API keys)")
    group.add_argument(
        "--tls-cert", metavar="PEM", help="certificate chain; with --tls-key: TLS (default: $CDB_TLS_CERT)"
    )
    group.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert (default: $CDB_TLS_KEY)")
    group.add_argument(
        "--tls-client-ca",
        metavar="PEM",
        help="require client certificates signed by this CA (default: $CDB_TLS_CLIENT_CA)",
    )
    group.add_argument(
        "--api-keys-file",
        metavar="FILE",
        help="API keys, one per line, '#' comments; calls need 'authorization: Bearer KEY' "
        "(default: $CDB_API_KEYS_FILE)",
    )


def public_port_env(args: argparse.Namespace) -> dict[str, str]:
    """The ``CDB_*`` variables that the public-port flags given set (absolute paths: children may run elsewhere)."""
    return {var: os.path.abspath(value) for name, var in PUBLIC_PORT_FLAGS.items() if (value := getattr(args, name))}


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
    parser.add_argument("--ready-file", help="write the bound address here once ready")
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: $CDB_METRICS_ADDR; unset or empty: none)",
    )
    parser.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API here (default: $CDB_HTTP_ADDR; unset or empty: none)",
    )
    add_served_name_arg(parser)
    add_config_arg(parser)
    add_log_args(parser, conf)
    add_public_port_args(parser)
    add_engine_args(parser, conf.engine)
    return parser


def scheduler_main(argv: list[str] | None = None) -> int:
    """``cdb scheduler``: serve ``cdb.v1.Generation`` over stage servers until SIGTERM/SIGINT, then drain."""
    from cdb_engine.preflight import check_config
    from services.http import serve_api
    from services.net import check_can_listen
    from services.scheduler.security import PortSecurity
    from services.scheduler.server import run_scheduler
    from services.transport.segments import SharedMemoryFull, sweep_stale_segments

    die_with_parent()
    parsed = parse_command(argv, "cdb scheduler", scheduler_parser)
    if parsed is None:
        return 2
    conf, parser, args = parsed
    pin_cpus("scheduler", conf.settings)
    configure_logging("scheduler", conf.settings, args.log_level, args.request_log)
    try:
        stage_addrs = None if args.in_process else parse_stage_addrs(args.stage)
        standby_addrs = parse_stage_addrs(args.standby_stage, "--standby-stage", complete=False)
        source = resolve_model_arg(args)
        config = engine_config_from_args(args)
        if args.metrics_listen and not is_host_port(args.metrics_listen):
            raise ValueError(f"--metrics-listen must be HOST:PORT, got {args.metrics_listen!r}")
        settings = load_configuration({**os.environ, **public_port_env(args)}, args.config).settings
        names = served_model_names(args, settings, source)
        settings = dataclasses.replace(settings, served_model_name=",".join(names))
        PortSecurity.from_settings(settings)  # TLS files and API keys, checked before the model loads
        http = settings.http_addr if args.http is None else args.http
        if http and not is_host_port(http):
            raise ValueError(f"--http must be HOST:PORT, got {http!r}")
        check_config(config)  # a bad model path, preset, device: one line before anything loads
    except ModelNotFoundError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
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
            metrics_listen=args.metrics_listen,
            companion=functools.partial(serve_api, address=http) if http else None,
            standby_addrs=standby_addrs,
        )
    except (ListenError, SharedMemoryFull) as exc:  # a port taken, /dev/shm too small: one line, not a traceback
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    return 0
