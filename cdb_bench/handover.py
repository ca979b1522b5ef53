"""``cdb bench handover``: what handing work to another process costs on this host, as the stage rings do it.

Every op and every reply crosses a process boundary: the sender publishes it in shared memory and wakes the
receiver's futex (``services.transport.futex``). Two processes over one shared page, ``--trials`` times each:

- ``wake_cpu_us`` / ``wake_wall_us``: the sender's CPU and wall time in a wake that finds the receiver asleep (it
  must be scheduled: on a virtual machine an inter-processor interrupt, tens of microseconds of the sender's CPU);
- ``wake_no_sleeper_us``: a wake that finds no one (the system call alone);
- ``wakeup_latency_us``: from the sender's publishing to the sleeping receiver running;
- ``spin_latency_us``: the same to a receiver that busy-waits instead (no wake at all: the cost is its core).

On a host where a wake costs much more than the work it hands over, busy-waiting receivers
(``CDB_FENCE_SPIN_S``) are worth the cores they hold; on one with few cores they take the cores the senders need.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import os
import statistics
import sys
import time
from typing import Any

from cdb_bench.stats import order_statistic
from services.transport import futex

_GO, _DONE, _SPIN = 0, 1, 2  # int32 words (bytes 0..12)
_STAMP = 2  # int64 slot (bytes 16..24): when the receiver ran


def measure(trials: int, gap_s: float = 300e-6) -> dict[str, Any]:
    """Run the receiver in a forked child; ``gap_s`` before each trial lets it fall asleep."""
    if not futex.AVAILABLE or not hasattr(os, "fork"):
        raise RuntimeError("needs Linux futexes and fork")
    page = mmap.mmap(-1, mmap.PAGESIZE)  # shared with the child (MAP_SHARED)
    words, stamps = memoryview(page).cast("i"), memoryview(page).cast("q")
    base = ctypes.addressof(ctypes.c_char.from_buffer(page))
    go, done = base + 4 * _GO, base + 4 * _DONE
    pid = os.fork()
    if pid == 0:  # the receiver: sleeps on GO for the wake trials, then busy-waits on SPIN
        try:
            last = 0
            for _ in range(trials):
                while words[_GO] == last:
                    futex.wait(go, last, 1.0)
                stamps[_STAMP] = time.perf_counter_ns()
                last = words[_GO]
                words[_DONE] = last
                futex.wake(done)
            last = 0
            for _ in range(trials):
                while words[_SPIN] == last:
                    pass
                stamps[_STAMP] = time.perf_counter_ns()
                last = words[_SPIN]
                words[_DONE] = -last
        finally:
            os._exit(0)
    wake_cpu, wake_wall, no_sleeper, latency, spin = [], [], [], [], []
    try:
        for i in range(1, trials + 1):
            time.sleep(gap_s)
            t0 = time.perf_counter_ns()
            words[_GO] = i
            c = time.thread_time_ns()
            futex.wake(go)
            wake_cpu.append(time.thread_time_ns() - c)
            wake_wall.append(time.perf_counter_ns() - t0)
            t = time.perf_counter_ns()
            futex.wake(base + 4 * _SPIN)  # (no one sleeps on that word)
            no_sleeper.append(time.perf_counter_ns() - t)
            while words[_DONE] != i:
                futex.wait(done, words[_DONE], 1.0)
            latency.append(stamps[_STAMP] - t0)
        for i in range(1, trials + 1):
            time.sleep(gap_s)
            t0 = time.perf_counter_ns()
            words[_SPIN] = i
            while words[_DONE] != -i:
                pass
            spin.append(stamps[_STAMP] - t0)
    finally:
        os.waitpid(pid, 0)
    figures = {
        "wake_cpu_us": wake_cpu,
        "wake_wall_us": wake_wall,
        "wake_no_sleeper_us": no_sleeper,
        "wakeup_latency_us": latency,
        "spin_latency_us": spin,
    }
    out: dict[str, Any] = {"trials": trials, "cores": len(os.sched_getaffinity(0))}
    for name, ns in figures.items():
        ns.sort()
        p50, p90 = order_statistic(ns, 0.5, math.ceil), order_statistic(ns, 0.9, math.floor)
        out[name] = {"p50": p50 / 1e3, "p90": p90 / 1e3}
        out[name]["mean"] = statistics.fmean(ns) / 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cdb bench handover", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--trials", type=int, default=2000, help="hand-overs of each kind (default 2000)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.trials < 1:
        p.error("--trials must be at least 1")
    try:
        out = measure(args.trials)
    except RuntimeError as exc:
        print(f"cdb bench handover: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['trials']} hand-overs each, {out['cores']} cores: p50 / p90 / mean us")
    for name in ("wake_cpu_us", "wake_wall_us", "wake_no_sleeper_us", "wakeup_latency_us", "spin_latency_us"):
        f = out[name]
        print(f"  {name[:-3]:<20}{f['p50']:9.1f}{f['p90']:9.1f}{f['mean']:9.1f}")
    return 0
