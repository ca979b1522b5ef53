"""``cdb serve`` and ``cdb demo``: the whole process tree on this machine."""

from __future__ import annotations

import argparse
import sys

from cdb_engine.options import add_engine_args, engine_config_from_args
from cdb_model.loader import DEFAULT_MODEL
from clients.common import StreamToken
from clients.sync_client import Client
from services.launcher import serve_all, serve_forever
from services.net import is_host_port
from services.settings import load_settings


def _serve_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="public address, HOST:PORT (port 0: any)")
    add_engine_args(parser)
    parser.set_defaults(model=DEFAULT_MODEL)  # the shipped trained model (models/ouro-kjv)
    return parser


def serve_main(argv: list[str] | None = None) -> int:
    """``cdb serve``: the scheduler and the three stages on this machine, until Ctrl-C / SIGTERM."""
    parser = _serve_parser("cdb serve", serve_main.__doc__ or "")
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        default=load_settings().metrics_addr,
        help="the scheduler's Prometheus endpoint, http://HOST:PORT/metrics (default: $CDB_METRICS_ADDR; empty: none)",
    )
    args = parser.parse_args(argv)
    try:
        config = engine_config_from_args(args)
        if args.metrics_listen and not is_host_port(args.metrics_listen):
            raise ValueError(f"--metrics-listen must be HOST:PORT, got {args.metrics_listen!r}")
    except ValueError as exc:
        parser.error(str(exc))
    return serve_forever(config, args.listen, args.metrics_listen)


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


def demo_main(argv: list[str] | None = None) -> int:
    """``cdb demo``: serve the embedded default, stream one generation (each token marked by its depth), stop."""
    parser = _serve_parser("cdb demo", demo_main.__doc__ or "")
    parser.set_defaults(listen="127.0.0.1:0")
    parser.add_argument("--prompt", default="And God said unto Moses,")
    parser.add_argument("--max-tokens", dest="demo_max_tokens", type=int, default=48)
    parser.add_argument("--temperature", dest="demo_temperature", type=float, default=0.8)
    parser.add_argument("--seed", dest="demo_seed", type=int, default=7)
    parser.add_argument("--no-colour", dest="demo_colour", action="store_false", help="mark depths as token[d]")
    args = parser.parse_args(argv)
    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    colour = args.demo_colour and sys.stdout.isatty()
    print(f"starting the prelude, loop and head stages and the scheduler for {config.model} ...", flush=True)
    with serve_all(config, args.listen) as handle, Client(handle.address) as client:
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
