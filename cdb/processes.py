"""``cdb stage`` and ``cdb scheduler``: one process of the tree each (the launcher's and compose's commands); and
``resolve_command``, the one resolution of a command's configuration that every ``cdb`` process runs."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Mapping

from cdb.model_source import ModelSource, resolve_model
from cdb_engine.config import EngineConfig
from cdb_engine.config_source import ENGINE_FIELDS
from cdb_engine.options import add_engine_args
from cdb_scheduler.plan import Stage
from services.launcher import die_with_parent, pin_cpus
from services.net import ListenError, is_host_port, parse_stage_addrs
from services.settings import (
    LOG_LEVELS,
    Configuration,
    Resolved,
    Settings,
    SettingsError,
    handed_configuration,
    load_configuration,
    served_names,
)
from services.telemetry.logs import configure_logging
from services.version import server_version

# The engine flags of ``cdb stage``: what a stage loads (its other fields come from its source, and what it serves
# with from the scheduler's Configure)
STAGE_ENGINE_FIELDS = ("model", "dtype", "device", "synthetic_cost", "synthetic_depths")


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


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    """``--chat-template FILE|TEMPLATE`` (over ``CDB_CHAT_TEMPLATE``)."""
    parser.add_argument(
        "--chat-template",
        metavar="FILE|TEMPLATE",
        help="the HTTP API's chat template instead of the tokenizer's: a Jinja file or the template itself "
        "(default: $CDB_CHAT_TEMPLATE; else the tokenizer's)",
    )


def served_model_names(args: argparse.Namespace, settings: Settings, source: ModelSource) -> list[str]:
    """The names the model is served under: ``--served-model-name``, else ``CDB_SERVED_MODEL_NAME``, else a hub id
    as the user named it (not its cache folder; [] otherwise: the APIs report the model as configured); ValueError
    for an empty name or one with a comma (``Settings.served_model_name`` holds them comma-separated)."""
    given = args.served_model_name or []
    if any(not name.strip() or "," in name for name in given):
        raise ValueError(f"--served-model-name takes names without commas, none empty; got {given!r}")
    named = [name.strip() for name in given] or served_names(settings.served_model_name)
    return named or ([source.name] if source.from_cache else [])


def resolve_model_arg(args: argparse.Namespace) -> ModelSource:
    """Resolve ``args.model`` (a hub id: its snapshot in the local Hugging Face cache) and put the path the loader
    reads in its place; ``ModelNotFoundError`` (one line) when a hub id is not in the cache."""
    source = resolve_model(args.model)
    args.model = source.path
    return source


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--config",
        metavar="FILE",
        help="config file (TOML; YAML for .yaml/.yml) of settings and engine options, under the CDB_* variables "
        "and these flags; keys as in services/settings.py (default: $CDB_CONFIG)",
    )
    group.add_argument(
        "--resolved-config",
        metavar="FILE",
        help="the whole configuration as a launcher resolved it (JSON; cdb serve writes one for its children): "
        "read instead of the CDB_* variables and any config file",
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
    """The source of a command's defaults: the document its ``--resolved-config`` names, else ``environ`` (default:
    ``os.environ``) and the config file its ``--config`` (or ``CDB_CONFIG``) names; SettingsError naming a bad
    value."""
    pre = argparse.ArgumentParser(prog=prog, add_help=False)
    pre.add_argument("--config", metavar="FILE")
    pre.add_argument("--resolved-config", metavar="FILE")
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.resolved_config:
        return handed_configuration(known.resolved_config)
    return load_configuration(environ, known.config)


# Flags that set a service setting (argparse dest -> Settings field); the paths among them are made absolute (a
# child may run elsewhere), the addresses checked as HOST:PORT (the error names the flag).
SETTING_FLAGS = {
    "log_level": "log_level",
    "request_log": "request_log",
    "metrics_listen": "metrics_addr",
    "http": "http_addr",
    "tls_cert": "tls_cert",
    "tls_key": "tls_key",
    "tls_client_ca": "tls_client_ca",
    "api_keys_file": "api_keys_file",
    "chat_template": "chat_template",
    "frontends": "frontends",
}
_PATH_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "api_keys_file")
_ADDRESS_FLAGS = {"metrics_listen": "--metrics-listen", "http": "--http"}


@dataclasses.dataclass(frozen=True)
class Command:
    """A command line resolved: the configuration the process runs with (``resolved``), the parsed ``args`` (for
    the options of this process alone: ``--listen``, ``--role``, ...), the ``parser`` and the model as named."""

    resolved: Resolved
    args: argparse.Namespace
    parser: argparse.ArgumentParser
    source: ModelSource


def _model_flag(argv: list[str]) -> str | None:
    """The value of ``--model`` in ``argv`` when it is given there (its default does not count)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--model")
    model: str | None = pre.parse_known_args(argv)[0].model
    return model


def _take_model_arg(args: argparse.Namespace, argv: list[str]) -> None:
    """``cdb serve MODEL``: MODEL is ``--model``; ValueError when both are given and differ."""
    if getattr(args, "model_arg", None) is None:
        return
    flag = _model_flag(argv)
    if flag is not None and flag != args.model_arg:
        raise ValueError(f"the model is named twice, {args.model_arg} (MODEL) and {flag} (--model): give one")
    args.model = args.model_arg


def _resolve(conf: Configuration, args: argparse.Namespace, source: ModelSource) -> Resolved:
    """The command's flags over its source: every engine field and setting a flag of this command sets."""
    given = vars(args)
    engine = EngineConfig(**{**conf.engine, **{name: given[name] for name in ENGINE_FIELDS if name in given}})
    for dest, flag in _ADDRESS_FLAGS.items():
        if (value := given.get(dest)) and not is_host_port(value):
            raise ValueError(f"{flag} must be HOST:PORT, got {value!r}")
    flags = {field: given[dest] for dest, field in SETTING_FLAGS.items() if given.get(dest) is not None}
    flags.update({name: os.path.abspath(flags[name]) for name in _PATH_FLAGS if name in flags})
    if "chat_template" in given and (template := flags.get("chat_template", conf.settings.chat_template)):
        from services.http.chat_template import ChatTemplateError, read_chat_template  # (FastAPI: only if set)

        try:  # checked before anything starts: read and compiled; a file's path made absolute
            read_chat_template(template)
        except ChatTemplateError as exc:
            raise ValueError(f"--chat-template (or CDB_CHAT_TEMPLATE): {exc}") from None
        if os.path.isfile(template):
            flags["chat_template"] = os.path.abspath(template)
    if "served_model_name" in given:
        flags["served_model_name"] = ",".join(served_model_names(args, conf.settings, source))
    return Resolved(dataclasses.replace(conf.settings, **flags), engine)


def resolve_command(
    argv: list[str] | None,
    prog: str,
    build: Callable[[Configuration], argparse.ArgumentParser],
    environ: Mapping[str, str] | None = None,
) -> Command:
    """The one resolution of a ``cdb`` command, highest first: its flags, then its source (``read_configuration``:
    the launcher's document, or the ``CDB_*`` variables over the config file over the defaults), which are the
    flags' defaults in ``prog``'s parser (``build``). The model is resolved too (a hub id: its cache snapshot).
    Raises SettingsError (a bad setting) or ValueError (the model not found or named twice), one line each; a bad
    flag value exits 2 through the parser."""
    conf = read_configuration(argv, environ, prog=prog)
    parser = build(conf)
    args = parser.parse_args(argv)
    _take_model_arg(args, sys.argv[1:] if argv is None else argv)
    source = resolve_model_arg(args)
    try:
        resolved = _resolve(conf, args, source)
    except ValueError as exc:
        parser.error(str(exc))
    return Command(resolved, args, parser, source)


def process_resolution(command: str, argv: list[str], environ: Mapping[str, str]) -> Resolved:
    """The configuration that ``cdb stage ARGV`` or ``cdb scheduler ARGV`` runs with in ``environ``, without
    running it."""
    build = {"stage": stage_parser, "scheduler": scheduler_parser, "frontend": frontend_parser}[command]
    return resolve_command(argv, f"cdb {command}", build, environ).resolved


def parse_command(
    argv: list[str] | None, prog: str, build: Callable[[Configuration], argparse.ArgumentParser]
) -> Command | None:
    """``resolve_command`` for a command's main: a bad setting or model prints one line and gives None (the
    command exits 2)."""
    try:
        return resolve_command(argv, prog, build)
    except SettingsError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
    return None


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


def add_public_api_args(parser: argparse.ArgumentParser, conf: Configuration) -> None:
    """The options of a process that serves the public API: HTTP, served names, chat template, the config file,
    logging, the public port's security and the engine's options."""
    parser.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API here (default: $CDB_HTTP_ADDR; unset or empty: none)",
    )
    add_served_name_arg(parser)
    add_chat_template_arg(parser)
    add_config_arg(parser)
    add_log_args(parser, conf)
    add_public_port_args(parser)
    add_engine_args(parser, conf.engine)


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
        check_config(config)  # a bad model path, preset, device: one line before anything loads
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

    die_with_parent()
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
