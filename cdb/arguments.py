"""The option groups the ``cdb`` commands share: a parser whose help shows every default, the config file, logging,
the served names and chat template, the public port's security, and all of a public API's options."""

from __future__ import annotations

import argparse

from cdb_engine.options import add_engine_args
from services.settings.checks import LOG_LEVELS
from services.settings.source import Configuration
from services.version import server_version


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
    # (no abbreviations: ``--api-key`` must never be read as ``--api-keys-file``)
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter, allow_abbrev=False
    )
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


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's spellings of ``cdb serve``'s options (``docs/coming-from-vllm.md``): ``--host``/``--port`` of the
    HTTP API (over ``--http``), ``--api-key`` (repeatable, over ``CDB_API_KEYS``), ``--enforce-eager`` (no CUDA
    graphs). ``--max-model-len`` and ``--gpu-memory-utilization`` are engine options."""
    group = parser.add_argument_group("vLLM's spellings")
    group.add_argument("--host", help="the HTTP API's host (over --http's)")
    group.add_argument("--port", type=int, help="the HTTP API's port (over --http's)")
    group.add_argument("--api-key", action="append", metavar="KEY", help="an API key calls must send (repeat for more)")
    group.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs: every kernel launched (also CDB_CUDA_GRAPHS)"
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
