"""``cdb bench``: offline (full depth vs no-refill vs CDB), services (microservices vs in-process), serve (open-loop
serving: rate sweep, latencies, capacity knee), scheduler (planning CPU per loop step), step (loop-step time)."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with ``main(argv)``, help)
BENCHMARKS = {
    "offline": ("cdb_bench.offline", "full-depth vs no-refill vs CDB on one workload (in-process)"),
    "services": ("cdb_bench.services", "microservices vs in-process on one workload"),
    "serve": ("cdb_bench.serve.cli", "open-loop serving: rate sweep, latencies, goodput, capacity knee"),
    "scheduler": ("cdb_bench.scheduler_cost", "the scheduler's CPU per loop step against the step's compute"),
    "step": ("cdb_bench.step_time", "time one loop step per preset"),
    "hostpath": ("cdb_bench.hostpath", "the host path at GPU op speeds: the loop stage's busy fraction (synthetic)"),
    "routing": ("cdb_bench.routing.cli", "routing policies over replicas: simulated, then on real local replicas"),
    "speculative": ("cdb_bench.speculative", "self-speculative decoding on one stream: acceptance, ops per token"),
    "handover": ("cdb_bench.handover", "what waking another process costs this host (futex wake, wake-up, spin)"),
    "heap": ("cdb_bench.heap", "a full garbage collection in a stage's and the scheduler's process, settled or not"),
    "apicost": ("cdb_bench.apicost.cli", "CPU per output token through the public API, by process and activity"),
    "soak": ("cdb_bench.soak", "requests with cancels and deadlines while a random stage is killed every few seconds"),
    "structured": ("cdb_bench.structured", "structured output (JSON schema): valid rate, forced-token depths, costs"),
    "priority": ("cdb_bench.priority", "priorities at 2x overload: FIFO, priority, priority with depth (top TTFT)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="cdb bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, (_, text) in BENCHMARKS.items():
        sub.add_parser(name, help=text, add_help=False)
    if not argv or argv[0] not in BENCHMARKS:
        parser.parse_args(argv)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)
