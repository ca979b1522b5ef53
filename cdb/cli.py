"""The ``cdb`` command: serve, demo, generate, stage, scheduler, frontend, secret, trace, native, train, bench,
eval, presets."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from services.version import server_version

# name -> (module, function, help): each takes every word after its name (``main(argv)``).
COMMANDS = {
    "serve": ("cdb.serve", "serve_main", "start the scheduler and the three stages on this machine"),
    "demo": ("cdb.serve", "demo_main", "serve the embedded default, stream one generation, stop"),
    "generate": ("clients.cli", "generate_main", "stream a generation from a running server"),
    "stage": ("cdb.processes", "stage_main", "run one stage server (prelude | loop | head)"),
    "scheduler": ("cdb.processes", "scheduler_main", "run the scheduler service"),
    "frontend": ("cdb.processes", "frontend_main", "run a front-end process over a scheduler's link (CDB_FRONTENDS)"),
    "train": ("cdb_train.cli", "main", "train the shipped looped model (prepare | train | lookahead | card)"),
    "bench": ("cdb_bench.cli", "main", "benchmarks: offline, services, serve, scheduler, step (see cdb bench --help)"),
    "eval": (
        "cdb.evaluate",
        "main",
        "quality against depth per exit threshold q; --harness: lm_eval through the API over q",
    ),
    "secret": ("cdb.processes", "secret_main", "make the stage plane's secret file (0600) if it does not exist"),
    "trace": ("services.telemetry.trace_cli", "main", "receive OTLP spans here and print each request's trace tree"),
    "native": ("cdb.native", "main", "the scheduler compiled with mypyc: build | status | clean"),
}


def _presets(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="cdb presets", description="the shipped models and the built-in presets, with their F0/Fr"
    )
    parser.parse_args(argv)
    from cdb_model.loader import DEFAULT_MODEL, load_config, shipped_models
    from cdb_model.presets import preset_config, preset_names

    rows = [
        (f"{name}{' *' if name == DEFAULT_MODEL else ''}", "shipped", load_config(name)) for name in shipped_models()
    ]
    rows += [(name, "preset", preset_config(name)) for name in preset_names()]
    print(f"{'model':<14} {'kind':<8} {'arch':<7} {'F0':>10} {'Fr':>10} {'F0/Fr':>7} {'max depth':>9}")
    for name, kind, c in rows:
        f0, fr = c.param_counts()
        print(f"{name:<14} {kind:<8} {c.arch:<7} {f0:>10} {fr:>10} {f0 / fr:>7.3f} {c.max_depth:>9}")
    print("* the default model (cdb serve, cdb demo); shipped: trained weights in models/; presets: random weights")
    return 0


def _command(name: str) -> Callable[[list[str]], int | None]:
    if name == "presets":
        return _presets
    module, func, _ = COMMANDS[name]
    fn: Callable[[list[str]], int | None] = getattr(importlib.import_module(module), func)
    return fn


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdb", description="Continuous depth batching server for looped LMs")
    p.add_argument("--version", action="version", version=f"cdb {server_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (_, _, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    sub.add_parser("presets", help="list the built-in presets with their F0/Fr", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0] not in (*COMMANDS, "presets"):
        parser.parse_args(argv)  # prints usage / help, or the error
        return 2
    return int(_command(argv[0])(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
