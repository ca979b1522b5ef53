"""``cdb serve`` and ``cdb demo``: the whole process tree on this machine."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from cdb.arguments import (
    add_chat_template_arg,
    add_config_arg,
    add_log_args,
    add_public_port_args,
    add_served_name_arg,
    add_vllm_args,
    new_parser,
)
from cdb.resolution import parse_command
from cdb_engine.memory import plan_memory
from cdb_engine.options import add_engine_args, auto_or
from cdb_engine.preflight import ConfigError, check_config
from cdb_model.loader import DEFAULT_MODEL
from clients.messages import StreamToken
from clients.sync_client import Client
from services.api.security import PortSecurity, read_api_keys
from services.launcher.child import raise_open_files
from services.launcher.foreground import serve_forever
from services.launcher.tree import serve_all
from services.net import ListenError, check_can_listen
from services.settings.source import Configuration
from services.telemetry.logs import configure_logging


def _tree_parser(prog: str, description: str | None, conf: Configuration) -> argparse.ArgumentParser:
    parser = new_parser(prog, description)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="public address, HOST:PORT (port 0: any)")
    add_config_arg(parser)
    add_engine_args(parser, {"model": DEFAULT_MODEL, **conf.engine})  # default: the shipped model, models/ouro-kjv
    return parser


DEFAULT_HTTP_ADDR = "127.0.0.1:8000"  # the conventional port of an OpenAI-compatible server


def serve_parser(conf: Configuration) -> argparse.ArgumentParser:
    parser = _tree_parser("cdb serve", serve_main.__doc__, conf)
    parser.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        help="the model, as --model: a preset, a shipped model, a checkpoint folder or a Hugging Face id "
        "(ORG/NAME) in the local cache, never downloaded (default: --model)",
    )
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        default=conf.settings.metrics_addr,
        help="the scheduler's Prometheus endpoint, http://HOST:PORT/metrics; empty: none (also CDB_METRICS_ADDR)",
    )
    http = parser.add_mutually_exclusive_group()
    http.add_argument(
        "--http",
        metavar="HOST:PORT",
        # CDB_HTTP_ADDR or the config file, even empty (none), else the conventional port
        default=conf.settings.http_addr if "http_addr" in conf.origins else DEFAULT_HTTP_ADDR,
        help="the OpenAI-compatible HTTP API's address, beside gRPC; empty: none (also CDB_HTTP_ADDR)",
    )
    http.add_argument(
        "--no-http",
        dest="http",
        action="store_const",
        const="",
        default=argparse.SUPPRESS,
        help="serve gRPC only, no HTTP API (default: the HTTP API on, see --http)",
    )
    parser.add_argument(
        "--frontends",
        type=auto_or(int),
        metavar="N|auto",
        default=conf.settings.frontends,
        help="front-end processes serving the public ports over the scheduler's engine; 0: the scheduler serves "
        "them; auto (default): by the host's cores and the device (also CDB_FRONTENDS)",
    )
    add_served_name_arg(parser)
    add_chat_template_arg(parser)
    add_log_args(parser, conf)
    parser.add_argument(
        "--log-dir",
        metavar="DIR",
        default=conf.settings.log_dir or None,
        help="also keep each process's log lines in DIR/NAME.log (they are on this command's stderr either way; "
        "also CDB_LOG_DIR)",
    )
    add_public_port_args(parser)
    add_vllm_args(parser)
    return parser


def serve_main(argv: list[str] | None = None) -> int:
    """``cdb serve [MODEL]``: the scheduler and the three stages on this machine, gRPC and the OpenAI-compatible
    HTTP API, until Ctrl-C / SIGTERM / SIGHUP."""
    command = parse_command(argv, "cdb serve", serve_parser)
    if command is None:
        return 2
    parser, args, resolved = command.parser, command.args, command.resolved
    settings = resolved.settings
    configure_logging("launcher", settings)
    raise_open_files()  # (its children inherit the limit; each raises its own too)
    try:
        PortSecurity.from_settings(settings)  # bad TLS files or keys: fail before the tree starts
    except ValueError as exc:
        parser.error(str(exc))
    try:  # a bad model path, preset, dtype or device, a plan that cannot fit: one line, before any child starts
        resolved = dataclasses.replace(resolved, engine=check_config(resolved.engine))
    except ConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    print(f"cdb serve: {plan_memory(resolved.engine).describe()}", flush=True)
    try:
        check_can_listen(args.listen)
        if settings.http_addr:
            _check_http_port(settings.http_addr)
    except ListenError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    if command.source.from_cache:
        print(f"cdb serve: {command.source.name} from the local Hugging Face cache, {command.source.path}", flush=True)
    return serve_forever(resolved, args.listen)


def _check_http_port(address: str) -> None:
    try:
        check_can_listen(address)
    except ListenError as exc:  # most often a second server on the conventional port
        raise ListenError(f"{exc} (the HTTP API: --http HOST:PORT moves it, --no-http turns it off)") from None


_DEPTH_COLOURS = {1: "32", 2: "36", 3: "33", 4: "31"}  # ANSI: green, cyan, yellow, red; deeper: magenta


def _show(text: str, depth: int, colour: bool) -> str:
    if colour:
        return f"\033[{_DEPTH_COLOURS.get(depth, '35')}m{text}\033[0m"
    return f"{text}[{depth}]"


def _depth_summary(depths: list[int], max_depth: int) -> str:
    counts = {d: depths.count(d) for d in range(1, max_depth + 1)}
    hist = "  ".join(f"{d}: {c} ({100 * c / len(depths):.0f} %)" for d, c in counts.items())
    mean = sum(depths) / len(depths)
    saved = 1 - mean / max_depth
    return f"served depths  {hist}\nmean depth {mean:.2f} of {max_depth}: {100 * saved:.0f} % of the loop compute saved"


def demo_parser(conf: Configuration) -> argparse.ArgumentParser:
    parser = _tree_parser("cdb demo", demo_main.__doc__, conf)
    parser.set_defaults(listen="127.0.0.1:0")
    parser.add_argument("--prompt", default="And God said unto Moses,", help="the prompt of the generation")
    parser.add_argument("--max-tokens", dest="demo_max_tokens", type=int, default=48, help="tokens to generate")
    parser.add_argument(
        "--temperature", dest="demo_temperature", type=float, default=0.8, help="sampling temperature (0: greedy)"
    )
    parser.add_argument("--seed", dest="demo_seed", type=int, default=7, help="sampling seed")
    parser.add_argument(
        "--no-colour",
        dest="demo_colour",
        action="store_false",
        help="mark depths as token[d] instead of colours (default: colours on a terminal)",
    )
    return parser


def demo_main(argv: list[str] | None = None) -> int:
    """``cdb demo``: serve the embedded default, stream one generation (each token marked by its depth), stop."""
    command = parse_command(argv, "cdb demo", demo_parser)
    if command is None:
        return 2
    args, config, settings = command.args, command.resolved.engine, command.resolved.settings
    colour = args.demo_colour and sys.stdout.isatty()
    print(f"starting the prelude, loop and head stages and the scheduler for {config.model} ...", flush=True)
    keys = read_api_keys(settings)  # a tree with API keys on: the demo calls it as its first key's holder
    tree = serve_all(config, args.listen, settings=settings)
    with tree as handle, Client(handle.address, api_key=keys[0] if keys else None) as client:
        max_depth = client.info().max_depth
        legend = "  ".join(_show(f"depth {d}", d, colour) for d in range(1, max_depth + 1))
        print(f"serving on {handle.address}; one generation, each token by its served loop depth ({legend}):")
        print(args.prompt, end="", flush=True)
        options = {"max_tokens": args.demo_max_tokens, "temperature": args.demo_temperature, "seed": args.demo_seed}
        depths: list[int] = []
        for item in client.stream(args.prompt, **options):
            if isinstance(item, StreamToken):
                depths.append(item.depth)
                print(_show(item.text or f"<{item.id}>", item.depth, colour), end="", flush=True)
            else:
                print(
                    f"\n\nfinish: {item.finish_reason}, {item.generated_tokens} tokens, {item.total_loop_steps} steps"
                )
        if depths:
            print(_depth_summary(depths, max_depth))
    return 0
