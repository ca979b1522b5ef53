"""Where a serving process's CPU goes, by activity: each thread's CPU time over a window (``/proc``), split by the
stack samples ``py-spy`` (a sampling profiler that reads another process's Python stacks) took of it, each sample
given to the activity of its innermost frame that a rule names (``split``).

``ACTIVITIES`` is the one table: ``(activity, (pattern, ...))``, a pattern matched against a frame's
``function (file:line)`` text; for each sample the frames are tried from the innermost out and the first frame
that any rule matches decides (rules in table order within a frame). Samples whose innermost frame waits
(``WAIT``: a futex, a condition, a gRPC thread blocked in its C core) are idle, not CPU, and are left out. Frames
of compiled code (the mypyc-built planner, C extensions) are invisible to the sampler: their time shows in the
Python frame that called them (the engine loop's own line, for the planner; uvloop's own work, socket writes
included, as ``Runner.run``: the event loop).
"""

from __future__ import annotations

import collections
import os
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

# Innermost frames of a thread that waits: in a Python wait, or in the C code its innermost Python frame called
# (gRPC's serving, polling and stream threads block there; the sampler cannot always tell them from running ones)
WAIT = (
    "wait (",
    "Condition.wait",
    "_worker (concurrent/futures",
    "select (",
    "poll (selectors",
    "_serve (",
    "channel_spin",
    "consume_request_iterator",
    "_poll_wrapper",
    "StageService.Run (",
    "Thread.run (",
    "TMonitor.run",
)

ACTIVITIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("metrics and tracing", ("services/telemetry/", "prometheus_client/", "opentelemetry/")),
    ("detokenizing", ("cdb_engine/detokenizer.py", "tokenizers/", "HFTokenizer.decode")),
    (
        "stream encoding and writing",
        (
            "services/http/streaming.py",
            "services/http/responses.py",
            "RequestResponseCycle.send",
            "starlette/responses.py",
            "msgspec",
        ),
    ),
    ("front-end link", ("services/frontlink/",)),
    ("grpc", ("grpc/", "services/api/handlers.py", "cdb_api/")),
    (
        "validation and tokenization",
        ("services/http/generation.py", "services/http/schemas.py", "cdb_engine/prepare.py", "cdb_engine/validation"),
    ),
    (
        "http parsing and routing",
        ("uvicorn/", "httptools", "h11/", "starlette/", "fastapi/", "pydantic", "services/http/"),
    ),
    (
        "op encoding and sending",
        ("transport/records.py", "transport/convert.py", "transport/opfields.py", "StageLink.send", "MessageRing.put"),
    ),
    (
        "result handling",
        ("transport/results.py", "transport/executor.py", "transport/ordering.py", "transport/links.py", "_dispatch"),
    ),
    ("request streams", ("cdb_engine/stream.py", "services/api/door.py", "cdb_engine/client.py")),
    ("planning", ("cdb_scheduler/", "Engine._run (")),
    ("model compute", ("cdb_model/", "torch/")),
    ("stage plumbing", ("services/transport/stage", "cdb_engine/stage_worker.py", "cdb_engine/synthetic")),
    ("event loop", ("asyncio/", "uvloop", "Runner.run")),
)
OTHER = "other"
NATIVE = "unsampled threads (native code)"


class ProfilerMissing(RuntimeError):
    """py-spy cannot be run."""


def classify(frames: Sequence[str]) -> str | None:
    """The activity of one sample (``frames`` outermost first); None: the thread was waiting."""
    if frames and any(w in frames[-1] for w in WAIT):
        return None
    for frame in reversed(frames):
        for activity, patterns in ACTIVITIES:
            if any(p in frame for p in patterns):
                return activity
    return OTHER


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each thread of process ``pid`` has used so far (Linux ``/proc``)."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def split(raw_lines: Iterable[str], cpu: dict[int, float]) -> dict[str, float]:
    """Each activity's share of a process's CPU over a sampled window: ``raw_lines`` from ``py-spy record
    --threads --format raw`` (``thread (TID): NAME;frame;... COUNT``), ``cpu`` each thread's CPU seconds in the
    window. A thread's CPU is split by its busy samples; a thread that used CPU but was never sampled busy (its
    time in C code the sampler reads as waiting) counts as ``NATIVE``. The shares sum to 1 (empty: no CPU)."""
    counts: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw_lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        head, _, rest = stack.partition(";")
        if not rest or not n.isdigit() or not head.startswith("thread ("):
            continue
        activity = classify(rest.split(";"))
        if activity is not None:
            counts[int(head[len("thread (") :].split(")", 1)[0], 0)][activity] += int(n)
    total = sum(cpu.values())
    if total <= 0.0:
        return {}
    seconds: dict[str, float] = collections.defaultdict(float)
    for tid, used in cpu.items():
        mine = counts.get(tid)
        busy = sum(mine.values()) if mine else 0
        if not mine or not busy:
            seconds[NATIVE] += used
            continue
        for activity, k in mine.items():
            seconds[activity] += used * k / busy
    return {a: t / total for a, t in sorted(seconds.items(), key=lambda kv: -kv[1])}


def record(pids: dict[str, int], seconds: float, folder: Path, pyspy: str, rate: int = 100) -> dict[str, Path]:
    """Sample every process of ``pids`` (name -> pid) for ``seconds`` at once; the raw output file of each (a
    process py-spy could not sample is left out)."""
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for name, pid in pids.items():
        out = folder / f"{name}.raw"
        argv = [pyspy, "record", "--threads", "--format", "raw", "--rate", str(rate)]
        argv += ["--duration", str(max(1, round(seconds)))]
        argv += ["--pid", str(pid), "--output", str(out)]
        try:
            procs[name] = (subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)
        except OSError as exc:  # no py-spy here: the figures go on without activities
            raise ProfilerMissing(f"cannot run {pyspy!r} ({exc}): install py-spy or leave out --profile") from exc
    done: dict[str, Path] = {}
    for name, (proc, out) in procs.items():
        if proc.wait() == 0 and out.exists():
            done[name] = out
    return done
