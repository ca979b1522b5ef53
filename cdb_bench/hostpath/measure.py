"""What ``cdb bench hostpath`` reads off the machine and the tree: CPU seconds (this process, the machine, the
scheduler's counters), the steady window, the collector's pauses, and the figures between two readings."""

from __future__ import annotations

import os
import resource
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def host_cpu() -> dict[str, float]:
    """The machine's CPU seconds so far, all processes (``/proc/stat``): busy (neither idle nor waiting for I/O),
    and stolen (time a hypervisor ran someone else on this guest's CPUs while it had work)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    steal = ticks[7] if len(ticks) > 7 else 0
    guest = sum(ticks[8:10])  # (counted in user time already)
    return {"host_busy_s": (sum(ticks) - guest - idle - steal) / hz, "host_steal_s": steal / hz}


def scrape(url: str) -> dict[str, float]:
    """The scheduler's counters this benchmark reads, from its Prometheus exposition (by name and label, whatever
    other labels a series carries: ``model_name``)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "cdb_engine_thread_cpu_seconds_total":
                out[f"cpu_{sample.labels['part']}"] = sample.value
            elif sample.name in ("cdb_loop_steps_total", "cdb_generation_tokens_total"):
                out[sample.name] = sample.value
            elif sample.name == "cdb_stage_compute_seconds_count" and sample.labels.get("stage") == "loop":
                out["loop_ops"] = sample.value
    return out


def steady_window(warmup_s: float, seconds: float) -> Iterator[None]:
    time.sleep(warmup_s)  # the steady window starts after the admission ramp
    yield
    time.sleep(seconds)
    yield


class GcPauses:
    """The cyclic collector's pauses in this process (the scheduler's, with tokens consumed in-process): each
    collection's generation and start and end (perf_counter ns)."""

    def __init__(self) -> None:
        self.started = 0
        self.pauses: list[tuple[int, int, int]] = []

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter_ns()
        if phase == "start":
            self.started = now
        elif self.started:
            self.pauses.append((info["generation"], self.started, now))

    def within(self, t0: float, t1: float) -> dict[str, float]:
        """Collections that ended in ``[t0, t1]``: how many, the full ones (generation 2), the longest pause and the
        total (ms)."""
        got = [(g, (end - start) / 1e6) for g, start, end in self.pauses if t0 <= end <= t1]
        return {
            "collections": len(got),
            "full": sum(g == 2 for g, _ in got),
            "max_ms": max((ms for _, ms in got), default=0.0),
            "total_ms": sum(ms for _, ms in got),
        }


def figures(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
    steps = max(1.0, b["loop_ops"] - a["loop_ops"])
    wall = (b["t"] - a["t"]) / 1e9
    per_step = {k[4:]: 1e6 * (b[k] - a[k]) / steps for k in a if k.startswith("cpu_")}
    cores = len(os.sched_getaffinity(0))
    busy, steal = b["host_busy_s"] - a["host_busy_s"], b["host_steal_s"] - a["host_steal_s"]
    thread = per_step.pop("thread")
    engine_parts = per_step["plan"] + per_step["submit"] + per_step["dispatch"]
    per_step["engine_other"] = max(0.0, thread - engine_parts)
    per_step["other_threads"] = max(0.0, per_step["process"] - thread)
    return {
        "window": (a["t"], b["t"]),
        "loop_stage_cpu_us_per_op": 1e6 * (b["loop_stage_cpu_s"] - a["loop_stage_cpu_s"]) / steps,
        "wall_s": wall,
        "tokens_per_s": (b["tokens"] - a["tokens"]) / wall,
        "loop_ops_window": steps,
        "sched_cpu_us_per_step": per_step,
        "host": {
            "cores": cores,
            "busy": busy / (cores * wall),
            "steal": steal / (cores * wall),
            "cpu_us_per_op": 1e6 * busy / steps,
        },
    }
