"""The ``cdb`` command: serve, generate, demo, bench, presets."""

from __future__ import annotations

import argparse
import sys


def _presets(_: argparse.Namespace) -> int:
    from cdb_model.presets import preset_config, preset_names

    print(f"{'preset':<14} {'arch':<7} {'F0':>10} {'Fr':>10} {'F0/Fr':>7} {'max depth':>9}")
    for name in preset_names():
        c = preset_config(name)
        f0, fr = c.param_counts()
        print(f"{name:<14} {c.arch:<7} {f0:>10} {fr:>10} {f0 / fr:>7.3f} {c.max_depth:>9}")
    return 0


def _bench_offline(args: argparse.Namespace) -> int:
    from cdb_engine import bench

    return bench.main(args)


def _bench_services(args: argparse.Namespace) -> int:
    from services import bench_services

    return int(bench_services.main(args.rest) or 0)


def _passthrough(module: str, func: str) -> object:
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(getattr(importlib.import_module(module), func)(args.rest) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdb", description="Continuous depth batching server for looped LMs")
    sub = p.add_subparsers(dest="command", required=True)
    for name, module, func, text in [
        ("serve", "services.launcher", "serve_main", "start the scheduler and the three stages on this machine"),
        ("demo", "services.launcher", "demo_main", "serve the embedded default, stream one generation, stop"),
        ("generate", "clients.cli", "generate_main", "stream a generation from a running server"),
        ("stage", "services.stage_server", "main", "run one stage server (prelude | loop | head)"),
        ("scheduler", "services.scheduler_server", "main", "run the scheduler service"),
    ]:
        sp = sub.add_parser(name, help=text, add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
        sp.set_defaults(func=_passthrough(module, func))
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    off = bench.add_parser("offline", help="full-depth vs no-refill vs CDB on one workload (in-process)")
    from cdb_engine.bench import add_arguments

    add_arguments(off)
    off.set_defaults(func=_bench_offline)
    svc = bench.add_parser("services", help="microservices vs in-process on one workload", add_help=False)
    svc.add_argument("rest", nargs=argparse.REMAINDER)
    svc.set_defaults(func=_bench_services)
    pr = sub.add_parser("presets", help="list the built-in presets with their F0/Fr")
    pr.set_defaults(func=_presets)
    return p


def main(argv: list[str] | None = None) -> int:
    # Subcommands that own their options (serve, generate, ...) get every word after their name.
    args, extra = build_parser().parse_known_args(argv)
    if hasattr(args, "rest"):
        args.rest = [*extra, *args.rest]
    elif extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
