"""``cdb serve`` and ``cdb demo``: the whole process tree on this machine."""

from __future__ import annotations

import argparse

from cdb_engine.options import add_engine_args, engine_config_from_args
from clients.common import StreamToken
from clients.sync_client import Client
from services.launcher import serve_all, serve_forever
from services.net import is_host_port
from services.settings import load_settings


def _serve_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="public address, HOST:PORT (port 0: any)")
    add_engine_args(parser)
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


def demo_main(argv: list[str] | None = None) -> int:
    """``cdb demo``: serve the embedded default, stream one generation (with depths), stop."""
    parser = _serve_parser("cdb demo", demo_main.__doc__ or "")
    parser.set_defaults(listen="127.0.0.1:0")
    parser.add_argument("--prompt", default="Looped models think deeper on harder tokens.")
    parser.add_argument("--max-tokens", dest="demo_max_tokens", type=int, default=32)
    parser.add_argument("--temperature", dest="demo_temperature", type=float, default=0.8)
    parser.add_argument("--seed", dest="demo_seed", type=int, default=7)
    args = parser.parse_args(argv)
    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"starting the prelude, loop and head stages and the scheduler for {config.model} ...", flush=True)
    with serve_all(config, args.listen) as handle, Client(handle.address) as client:
        print(
            f"serving on {handle.address}; streaming one generation (token[served loop depth]; a tiny random "
            "model: the text is noise, the depths are real):",
            flush=True,
        )
        options = {"max_tokens": args.demo_max_tokens, "temperature": args.demo_temperature, "seed": args.demo_seed}
        for item in client.stream(args.prompt, ignore_eos=True, **options):
            if isinstance(item, StreamToken):
                print(f"{item.text or f'<{item.id}>'}[{item.depth}]", end=" ", flush=True)
            else:
                print(f"\nfinish: {item.finish_reason}, {item.generated_tokens} tokens, {item.total_loop_steps} steps")
    return 0
