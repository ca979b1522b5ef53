"""``cdb bench``: offline (full depth vs no-refill vs CDB), services (microservices vs in-process), step."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="cdb bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    sub.add_parser("offline", help="full-depth vs no-refill vs CDB on one workload (in-process)", add_help=False)
    sub.add_parser("services", help="microservices vs in-process on one workload", add_help=False)
    sub.add_parser("step", help="time one loop step per preset", add_help=False)
    if not argv or argv[0] not in ("offline", "services", "step"):
        parser.parse_args(argv)
        return 2
    name, rest = argv[0], argv[1:]
    if name == "offline":
        from cdb_bench import offline

        return offline.main(rest)
    if name == "services":
        from cdb_bench import services

        return services.main(rest)
    from cdb_bench import step_time

    return step_time.main(rest)
