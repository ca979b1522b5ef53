"""``resolve_command``: the one resolution of a ``cdb`` command's configuration that every ``cdb`` process runs,
its flags over its source (the launcher's document, or the ``CDB_*`` variables over the config file over the
defaults), the model resolved too."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping

from cdb.model_source import ModelSource, resolve_model
from cdb_engine.config import EngineConfig
from cdb_engine.config_source import ENGINE_FIELDS
from services.net import is_host_port
from services.settings.checks import SettingsError, served_names
from services.settings.knobs import Settings
from services.settings.resolved import Resolved
from services.settings.source import Configuration, handed_configuration, load_configuration


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
    "log_dir": "log_dir",
}
_PATH_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "api_keys_file", "log_dir")
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


def _vllm_flags(given: Mapping[str, object], http: str) -> dict[str, object]:
    """The settings vLLM's spellings set (``cdb.arguments.add_vllm_args``): ``--host``/``--port`` over the HTTP
    API's address ``http``, ``--api-key`` (the keys), ``--enforce-eager`` (no CUDA graphs)."""
    flags: dict[str, object] = {}
    host, port = given.get("host"), given.get("port")
    if host is not None or port is not None:
        if not http:
            raise ValueError("--host/--port: the HTTP API is off (--no-http or an empty --http)")
        old_host, _, old_port = http.rpartition(":")
        flags["http_addr"] = f"{host if host is not None else old_host}:{port if port is not None else old_port}"
        if not is_host_port(str(flags["http_addr"])):
            raise ValueError(f"--host/--port must make HOST:PORT, got {flags['http_addr']!r}")
    keys = given.get("api_key")
    if isinstance(keys, list) and keys:
        if any("," in k or not k.strip() for k in keys):
            raise ValueError("--api-key: a key must be non-empty and hold no comma")
        flags["api_keys"] = ",".join(keys)
    if given.get("enforce_eager"):
        flags["cuda_graphs"] = False
    return flags


def _resolve(conf: Configuration, args: argparse.Namespace, source: ModelSource) -> Resolved:
    """The command's flags over its source: every engine field and setting a flag of this command sets."""
    given = vars(args)
    engine = EngineConfig(**{**conf.engine, **{name: given[name] for name in ENGINE_FIELDS if name in given}})
    for dest, flag in _ADDRESS_FLAGS.items():
        if (value := given.get(dest)) and not is_host_port(value):
            raise ValueError(f"{flag} must be HOST:PORT, got {value!r}")
    flags = {field: given[dest] for dest, field in SETTING_FLAGS.items() if given.get(dest) is not None}
    flags.update(_vllm_flags(given, flags.get("http_addr", conf.settings.http_addr)))
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
