"""``cdb bench hostpath``: does the host path of a loop step fit inside a GPU step? Measured on synthetic stages.

The real deployed tree (three stage processes on the real transport: shared bank, fences, gRPC streams) runs on
synthetic stages (``cdb_engine.synthetic``: everything but the model's arithmetic, which becomes modelled device
time), in steady state: a closed loop of ``concurrency`` requests (new ones as old ones end) with live exit
decisions from the stages' drawn depths. Tokens are consumed two ways:

- ``in-process``: the scheduler runs in this process (``Engine`` over ``GrpcExecutor``), token ids go to sinks here
  (``submit(detokenize=False)``: text is a front end's work, which this consumer stands in for);
- ``api``: the whole tree with its scheduler process; streaming clients in another process over the public
  gRPC API;
- ``http``: the same over the HTTP API (server-sent events, the ``openai`` client).

With ``api`` and ``http``, ``--frontends N ...`` runs the tree with N front-end processes (``CDB_FRONTENDS``; 0:
the scheduler process serves the API) and reports their CPU per streamed token.

Per point (family x loop op time x width x consumer), over the steady window:

- ``eta``: the loop stage's busy fraction, modelled device time / wall time (from the loop stage's per-op
  timeline, ``CDB_STAGE_OP_LOG``);
- tokens/s, and against the ideal ``width / (mean depth x mean loop op time)`` (a busy loop stage at full width);
- the loop stage's idle time between ops, by cause: the op arrived late (the scheduler's host path), its fences
  (the head or prelude op it waits on), its preparation on the stage; the reaction time from an op's end to the
  arrival of the op that its reply lets the scheduler plan (``loop_pipeline_depth`` later), and, in-process on
  rings, that reaction split by hand-over (``reaction_split``: the stage's reply, the ring, the hop to the engine
  thread, the engine's planning and sending);
- the scheduler process's CPU per loop step, split by part: planning, submitting ops (transport on the engine
  thread), dispatching tokens (streaming on the engine thread), the engine thread's rest, and the process's other
  threads (gRPC transport threads; with ``api`` also the public front end); and the loop stage process's CPU per
  loop op (``loop_stage_cpu_us_per_op``: on a host with few cores, what it takes from the others);
- the machine's CPU over the window (``host``, from ``/proc/stat``: every process, the clients too): the fraction
  of its cores busy, the fraction stolen by a hypervisor, the CPU per loop op, and the busy fraction its cores could
  sustain at that cost (``eta_bound``: cores x mean loop op time / CPU per loop op, at most 1) — where η is far
  below it, the loop waits on a chain of hand-overs, not on the CPU as a whole.

Op times: the loop op costs ``OP`` µs flat (nearly flat in the batch, as on a GPU below saturation); the head
and prelude ops cost what the family's ``h200`` profile gives them relative to its loop op. ``--profiles`` adds
points on the named profiles themselves (``h200:ouro-1.4b``, ``h200:huginn-3.5b``: cost grows with tokens and
context).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import cdb_scheduler
from cdb_bench import outputs
from cdb_engine.config import EngineConfig, RequestParams, Speculative
from cdb_engine.engine import Engine, StageSetup
from cdb_engine.events import Event, FinishEvent, TokenEvent
from cdb_engine.synthetic import parse_cost
from cdb_scheduler.plan import Stage
from services import heap
from services.launcher import ServeHandle, serve_all, start_stages
from services.settings import load_settings
from services.telemetry.probe import HopLog
from services.transport.executor import GrpcExecutor, GrpcExecutorFactory

FAMILIES = {"ouro": ("ouro-bench", "h200:ouro-1.4b"), "huginn": ("huginn-bench", "h200:huginn-3.5b")}
CONSUMERS = ("in-process", "api", "http")
PROMPT_LEN = 32
OUTPUT_LEN = (128, 256)


def scaled_cost(family: str, op_us: float) -> str:
    """A flat cost SPEC whose loop op takes ``op_us``; head and prelude scaled as in the family's profile."""
    prof = parse_cost(FAMILIES[family][1])
    ratio = op_us / prof.loop.fixed_us
    parts = [f"loop={op_us:g}:0:0", f"head={prof.head.fixed_us * ratio:.1f}:0:0"]
    if prof.prelude.fixed_us:
        parts.append(f"prelude={prof.prelude.fixed_us * ratio:.1f}:0:0")
    return ",".join(parts)


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    family: str
    cost: str
    width: int
    consumer: str
    op_us: float | None  # None: a named profile
    fuse_loop_head: bool = True
    transport: str = "rings"  # the stage data plane: "rings" (shared memory) or "streams" (gRPC)
    frontends: int = 0  # api, http: front-end processes (CDB_FRONTENDS; 0: the scheduler process serves the API)

    @property
    def label(self) -> str:
        what = f"{self.op_us:g}us" if self.op_us is not None else self.cost
        fronts = f" fe{self.frontends}" if self.frontends else ""
        return f"{self.family} {what} w{self.width} {self.consumer}{fronts}"


def _params(rng: random.Random) -> RequestParams:
    return RequestParams(max_tokens=rng.randint(*OUTPUT_LEN), ignore_eos=True)


def _prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]


# ---------------------------------------------------------------------------------------------------- consumers


class _ClosedLoop:
    """In-process consumer: keeps ``concurrency`` requests in the engine; counts tokens on the engine thread. It asks
    for token ids only: making text is a front end's work (``cdb frontend``), off the scheduler process."""

    def __init__(self, engine: Engine, concurrency: int, seed: int) -> None:
        self.engine, self.rng = engine, random.Random(seed)
        self.tokens = 0
        self.stopping = False
        self.vocab = engine.model_config.vocab_size
        for _ in range(concurrency):
            self._submit()

    def _submit(self) -> None:
        if not self.stopping:
            prompt = _prompt(self.rng, self.vocab)
            self.engine.submit(prompt, _params(self.rng), self._sink, force=True, detokenize=False)

    def _sink(self, ev: Event) -> None:
        if isinstance(ev, TokenEvent):
            self.tokens += 1
        elif isinstance(ev, FinishEvent):
            self._submit()


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _host_cpu() -> dict[str, float]:
    """The machine's CPU seconds so far, all processes (``/proc/stat``): busy (neither idle nor waiting for I/O),
    and stolen (time a hypervisor ran someone else on this guest's CPUs while it had work)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    steal = ticks[7] if len(ticks) > 7 else 0
    guest = sum(ticks[8:10])  # (counted in user time already)
    return {"host_busy_s": (sum(ticks) - guest - idle - steal) / hz, "host_steal_s": steal / hz}


def _scrape(url: str) -> dict[str, float]:
    """The scheduler's counters this benchmark reads, from its Prometheus exposition."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("cdb_engine_thread_cpu_seconds_total{"):
            part = line.split('part="', 1)[1].split('"', 1)[0]
            out[f"cpu_{part}"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(("cdb_loop_steps_total ", "cdb_generation_tokens_total ")):
            name, value = line.split()
            out[name] = float(value)
        elif line.startswith('cdb_stage_compute_seconds_count{stage="loop"}'):
            out["loop_ops"] = float(line.rsplit(" ", 1)[1])
    return out


def _window(warmup_s: float, seconds: float) -> Iterator[None]:
    time.sleep(warmup_s)  # the steady window starts after the admission ramp
    yield
    time.sleep(seconds)
    yield


def run_in_process(point: Point, tree: ServeHandle, warmup_s: float, seconds: float, seed: int) -> dict[str, Any]:
    cfg = _config(point)
    factory = GrpcExecutorFactory(tree.stage_addrs, tree.settings)
    hops = HopLog()

    def executor(setup: StageSetup) -> GrpcExecutor:
        ex = factory(setup)
        ex.probe = hops  # the reaction's hand-overs, timed (``reaction_split``)
        return ex

    engine = Engine(cfg, executor).start()
    heap.settle()  # as the scheduler's process does once started (``run_scheduler``)
    pauses = _GcPauses()
    gc.callbacks.append(pauses)
    try:
        loop = _ClosedLoop(engine, _concurrency(point.width), seed)
        marks = []
        for _ in _window(warmup_s, seconds):
            st, cpu = engine.sched_stats, engine.cpu
            marks.append(
                {
                    "t": time.perf_counter_ns(),
                    "tokens": loop.tokens,
                    "loop_ops": st.ops[Stage.LOOP],
                    "cpu_process": _cpu_self(),
                    "cpu_plan": st.sched_cpu_s,
                    "cpu_submit": cpu.submit_s,
                    "cpu_dispatch": cpu.dispatch_s,
                    "cpu_thread": cpu.thread_s,
                    "loop_stage_cpu_s": _cpu_of(tree.stages[Stage.LOOP].pid),
                    "mean_depth": st.mean_depth,
                }
                | _host_cpu()
            )
        loop.stopping = True
    finally:
        gc.callbacks.remove(pauses)
        engine.shutdown()
    a, b = marks
    return _figures(a, b) | {"mean_depth": b["mean_depth"], "hops": hops, "gc": pauses.within(a["t"], b["t"])}


class _GcPauses:
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


def _figures(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
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


_CLIENT = r"""
import asyncio, contextlib, random, sys, time

proto, address, model = sys.argv[1:4]
concurrency, seed, vocab, plen, lo, hi = map(int, sys.argv[5:11])
seconds = float(sys.argv[4])
rng = random.Random(seed)

async def main():
    end = time.perf_counter() + seconds
    async with contextlib.AsyncExitStack() as stack:
        if proto == "http":  # server-sent events through the openai client
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=f"http://{address}/v1", api_key="none", timeout=600, max_retries=0)

            async def one(prompt, n):
                stream = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=n, stream=True, extra_body={"ignore_eos": True}
                )
                async for _ in stream:
                    pass
        else:
            from clients.async_client import AsyncClient

            client = await stack.enter_async_context(AsyncClient(address, timeout=600))

            async def one(prompt, n):
                async for _ in client.stream(prompt, max_tokens=n, ignore_eos=True):
                    pass

        async def worker():
            while time.perf_counter() < end:
                await one([rng.randrange(3, vocab) for _ in range(plen)], rng.randint(lo, hi))

        print("ready", flush=True)
        await asyncio.gather(*[worker() for _ in range(concurrency)])

asyncio.run(main())
"""


def run_api(point: Point, warmup_s: float, seconds: float, seed: int, op_log: str) -> dict[str, Any]:
    """The public API under streaming clients in another process: gRPC (``api``) or HTTP SSE (``http``, the
    ``openai`` client)."""
    cfg = _config(point)
    metrics_port = _free_port()
    env = {**os.environ, "CDB_STAGE_OP_LOG": op_log, "CDB_STAGE_RINGS": str(point.transport == "rings").lower()}
    env["CDB_FRONTENDS"] = str(point.frontends)
    http = f"127.0.0.1:{_free_port()}" if point.consumer == "http" else ""
    env["CDB_HTTP_ADDR"] = http
    with serve_all(cfg, "127.0.0.1:0", env=env, metrics_listen=f"127.0.0.1:{metrics_port}") as tree:
        assert tree.scheduler is not None
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        vocab = Engine(cfg).model_config.vocab_size
        where = ["http", http] if http else ["grpc", tree.address]
        argv = [*where, cfg.model, str(warmup_s + seconds + 60), str(_concurrency(point.width)), str(seed)]
        argv += [str(vocab), str(PROMPT_LEN), str(OUTPUT_LEN[0]), str(OUTPUT_LEN[1])]
        client = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, *argv], stdout=subprocess.PIPE, text=True, env=_no_pin(dict(os.environ))
        )
        try:
            assert client.stdout is not None
            client.stdout.readline()  # connected
            marks = []
            for _ in _window(warmup_s, seconds):
                m = _scrape(url)
                marks.append(
                    {
                        "t": time.perf_counter_ns(),
                        "tokens": m.get("cdb_generation_tokens_total", 0.0),
                        "loop_ops": m.get("loop_ops", 0.0),
                        "cpu_process": _cpu_of(tree.scheduler.pid),
                        "cpu_plan": m.get("cpu_plan", 0.0),
                        "cpu_submit": m.get("cpu_submit", 0.0),
                        "cpu_dispatch": m.get("cpu_dispatch", 0.0),
                        "cpu_thread": sum(m.get(f"cpu_{p}", 0.0) for p in ("plan", "submit", "dispatch", "other")),
                        "frontends_cpu_s": sum(_cpu_of(p.pid) for p in tree.frontends),
                        "loop_stage_cpu_s": _cpu_of(tree.stages[Stage.LOOP].pid),
                    }
                    | _host_cpu()
                )
                if len(marks) == 1:
                    depth0 = m
            if client.poll() is not None:  # the clients failed: no figure from an idle tree
                raise RuntimeError(f"the streaming clients exited with {client.returncode} during the window")
            mean_depth = (m["cdb_loop_steps_total"] - depth0["cdb_loop_steps_total"]) / max(
                1.0, m["cdb_generation_tokens_total"] - depth0["cdb_generation_tokens_total"]
            )
        finally:
            client.kill()
            client.wait()
    a, b = marks
    fig = _figures(a, b) | {"mean_depth": mean_depth}
    if point.frontends:  # the front ends' CPU per streamed token, and tokens streamed per second of their CPU
        tokens, cpu = b["tokens"] - a["tokens"], b["frontends_cpu_s"] - a["frontends_cpu_s"]
        fig["frontends_cpu_us_per_token"] = 1e6 * cpu / max(1.0, tokens)
        fig["tokens_per_frontend_core_s"] = tokens / max(1e-9, cpu)
    return fig


def _no_pin(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != "CDB_STAGE_OP_LOG"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _concurrency(width: int) -> int:
    return width + max(4, width // 4)  # a few waiting requests refill freed slots at once


def _config(point: Point) -> EngineConfig:
    model = FAMILIES[point.family][0]
    return EngineConfig(
        model=model,
        synthetic_cost=point.cost,
        max_num_seqs=point.width,
        max_waiting=4 * point.width,
        num_kv_blocks=point.width * (PROMPT_LEN + OUTPUT_LEN[1]) // 16 + 64,
        fuse_loop_head=point.fuse_loop_head,
        speculative=Speculative.OFF,  # the host path at steady load, where no request would draft anyway
    )


# ---------------------------------------------------------------------------------------------------- stage side


def reaction_split(ops: Sequence[Sequence[int]], hops: HopLog, window: tuple[int, int], depth: int) -> dict[str, Any]:
    """Where the reaction goes, from the end of loop op k to the sending of op k + ``depth`` (the op its reply lets
    the scheduler plan), hand-over by hand-over: the stage writes its reply (``stage_reply``), the engine thread
    reads it off the ring when it next polls (``ring``: mostly the engine busy with other work), takes its result
    (``to_engine``), plans and sends the op (``engine``: 0 when the op had gone before). p50 and mean, µs, over the
    window's loop replies (rings only); and the engine thread's CPU in sending a loop op (``send_cpu``: writing it
    to the ring and waking its stage, where it sleeps), over the window's loop ops."""
    t0, t1 = window
    ended = {r[0]: r[6] for r in ops}
    sent = {seq: ns for stage, seq, ns, _ in hops.sent if stage == Stage.LOOP}
    parts: dict[str, list[int]] = {"stage_reply": [], "ring": [], "to_engine": [], "engine": []}
    for stage, seq, written, read, polled in hops.replies:
        end, nxt = ended.get(seq), sent.get(seq + depth)
        if stage != Stage.LOOP or end is None or nxt is None or not t0 <= end <= t1:
            continue
        for key, ns in zip(parts, (written - end, read - written, polled - read, nxt - polled)):
            parts[key].append(max(0, ns))
    parts["send_cpu"] = [cpu for stage, seq, ns, cpu in hops.sent if stage == Stage.LOOP and t0 <= ns <= t1]
    return {
        key: {"p50": statistics.median(xs) / 1e3, "mean": statistics.fmean(xs) / 1e3} if xs else None
        for key, xs in parts.items()
    }


def loop_timeline(op_log: str, window: tuple[int, int], depth: int, hops: HopLog | None = None) -> dict[str, Any]:
    """The loop stage's busy fraction and its idle gaps by cause, over ``window`` (perf_counter ns); with ``hops``
    (the scheduler in this process) also the reaction's split (``reaction_split``)."""
    ops: list[list[int]] = []
    for path in glob.glob(os.path.join(op_log, "loop-*.json")):
        with open(path) as f:
            doc = json.load(f)
        ops.extend(doc["ops"])
    ops.sort(key=lambda r: r[6])  # by end: the loop stage runs its ops in order
    t0, t1 = window
    busy = 0.0
    late, fence, prep, idle = [], [], [], []
    reaction = []
    by_end = [r for r in ops if t0 <= r[6] <= t1]
    for i, r in enumerate(ops):
        _, _, arrived, dequeued, fenced, started, ended, compute = r
        lo, hi = max(started, t0), min(ended, t1)
        if hi > lo:
            busy += (hi - lo) * compute / max(1, ended - started)
        if i == 0 or not t0 <= started <= t1:
            continue
        prev_end = ops[i - 1][6]
        gap = max(0, started - prev_end)
        idle.append(gap)
        wait_arrival = min(gap, max(0, arrived - prev_end))
        late.append(wait_arrival)
        fence.append(min(gap - wait_arrival, max(0, fenced - max(dequeued, prev_end, arrived))))
        prep.append(max(0, gap - late[-1] - fence[-1]))
        if i + depth < len(ops):
            reaction.append(ops[i + depth][2] - ended)
    n = max(1, len(idle))
    computes = [r[7] for r in by_end]

    def q(xs: Sequence[int], p: float) -> float:
        return sorted(xs)[int(p * (len(xs) - 1))] / 1e3 if xs else 0.0

    split = {"reaction_split_us": reaction_split(ops, hops, window, depth)} if hops is not None else {}
    return split | {
        "eta": busy / max(1, t1 - t0),
        "loop_ops": len(by_end),
        "mean_loop_op_us": statistics.fmean(computes) / 1e3 if computes else 0.0,
        "mean_loop_tokens": statistics.fmean(r[1] for r in by_end) if by_end else 0.0,
        "idle_us_per_op": {
            "total": sum(idle) / n / 1e3,
            "op_arrived_late": sum(late) / n / 1e3,
            "fences": sum(fence) / n / 1e3,
            "stage_preparation": sum(prep) / n / 1e3,
        },
        "reaction_us": {"p50": q(reaction, 0.5), "p90": q(reaction, 0.9)},
        "idle_max_us": max(idle, default=0) / 1e3,  # the loop stage's longest gap (a pause anywhere on its path)
    }


# ---------------------------------------------------------------------------------------------------- driver


def run_point(point: Point, warmup_s: float, seconds: float, seed: int = 0) -> dict[str, Any]:
    op_log = tempfile.mkdtemp(prefix="cdb-oplog-")
    if point.consumer in ("api", "http"):
        fig = run_api(point, warmup_s, seconds, seed, op_log)
    else:
        settings = dataclasses.replace(load_settings(), stage_op_log=op_log, stage_rings=point.transport == "rings")
        env = {**os.environ, "CDB_STAGE_OP_LOG": op_log}
        with start_stages(_config(point), settings=settings, env=env) as tree:
            fig = run_in_process(point, tree, warmup_s, seconds, seed)
    fig |= loop_timeline(op_log, fig.pop("window"), _config(point).loop_pipeline_depth, fig.pop("hops", None))
    host = fig["host"]  # at what a loop op now costs the machine's CPU, how busy its cores could keep the loop stage
    host["eta_bound"] = min(1.0, host["cores"] * fig["mean_loop_op_us"] / max(1e-9, host["cpu_us_per_op"]))
    fig["ideal_tokens_per_s"] = point.width / max(1e-9, fig["mean_depth"] * fig["mean_loop_op_us"] / 1e6)
    fig["of_ideal"] = fig["tokens_per_s"] / fig["ideal_tokens_per_s"]
    where = {"family": point.family, "cost": point.cost, "op_us": point.op_us, "width": point.width}
    how = {"consumer": point.consumer, "fuse_loop_head": point.fuse_loop_head, "transport": point.transport}
    how["frontends"] = point.frontends
    return where | how | fig


def points(args: argparse.Namespace) -> list[Point]:
    out = []
    modes = itertools.product(args.families, args.consumers, args.fuse_loop_head, args.transport)
    for family, consumer, fused, transport in modes:
        for fronts in args.frontends if consumer != "in-process" else [0]:
            for op_us, width in itertools.product(args.op_us, args.widths):
                cost = scaled_cost(family, op_us)
                out.append(Point(family, cost, width, consumer, op_us, fused, transport, fronts))
            if args.profiles:
                cost = FAMILIES[family][1]
                out.extend(
                    Point(family, cost, width, consumer, None, fused, transport, fronts) for width in args.widths
                )
    return out


_IDENTITY = ("family", "cost", "op_us", "width", "consumer", "fuse_loop_head", "transport", "frontends")
_FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "eta": lambda r: r["eta"],
    "tokens_per_s": lambda r: r["tokens_per_s"],
    "of_ideal": lambda r: r["of_ideal"],
    "sched_cpu_us_per_step": lambda r: r["sched_cpu_us_per_step"]["process"],
    "loop_stage_cpu_us_per_op": lambda r: r["loop_stage_cpu_us_per_op"],
    "idle_op_arrived_late_us": lambda r: r["idle_us_per_op"]["op_arrived_late"],
    "idle_fences_us": lambda r: r["idle_us_per_op"]["fences"],
    "idle_stage_preparation_us": lambda r: r["idle_us_per_op"]["stage_preparation"],
    "reaction_p50_us": lambda r: r["reaction_us"]["p50"],
    "host_busy": lambda r: r["host"]["busy"],
    "host_steal": lambda r: r["host"]["steal"],
    "host_cpu_us_per_op": lambda r: r["host"]["cpu_us_per_op"],
    "eta_cpu_bound": lambda r: r["host"]["eta_bound"],
}


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point (its identity: family, cost, width, consumer, ...): how many runs, and each figure's median, lowest
    and highest over them (this machine's noise is in the range; a median moves little for one bad run)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in _IDENTITY), []).append(r)
    out = []
    for key, runs in groups.items():
        entry: dict[str, Any] = dict(zip(_IDENTITY, key)) | {"runs": len(runs)}
        for name, figure in _FIGURES.items():
            values = [figure(r) for r in runs]
            entry[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        out.append(entry)
    return out


def _median_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"medians over rounds: {'family':<7}{'cost':<18}{'w':>4} {'consumer':<11}{'runs':>5}{'eta':>7} {'(range)':<13}"
        f"{'tok/s':>9}{'cpu us/step':>12}{'late':>7}{'fence':>7}{'prep':>6}{'react':>7}"
        f"{'host busy':>10}{'steal':>6}{'bound':>6}"
    ]
    for r in rows:
        cost = f"{r['op_us']:g}us flat" if r["op_us"] is not None else r["cost"]
        e = r["eta"]
        spread = f"({e['min']:.2f}-{e['max']:.2f})"
        lines.append(
            f"{'':<21}{r['family']:<7}{cost:<18}{r['width']:>4} {_consumer(r):<11}{r['runs']:>5}{e['median']:>7.3f} "
            f"{spread:<13}{r['tokens_per_s']['median']:>9.0f}"
            f"{r['sched_cpu_us_per_step']['median']:>12.0f}{r['idle_op_arrived_late_us']['median']:>7.0f}"
            f"{r['idle_fences_us']['median']:>7.0f}{r['idle_stage_preparation_us']['median']:>6.0f}"
            f"{r['reaction_p50_us']['median']:>7.0f}{r['host_busy']['median']:>10.2f}"
            f"{r['host_steal']['median']:>6.2f}{r['eta_cpu_bound']['median']:>6.2f}"
        )
    return "\n".join(lines)


def _consumer(r: dict[str, Any]) -> str:
    return f"{r['consumer']} fe{r['frontends']}" if r.get("frontends") else str(r["consumer"])


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'family':<7}{'cost':<18}{'w':>4} {'consumer':<11}{'fused':<6}{'data':<8}{'eta':>6}{'of ideal':>9}"
        f"{'tok/s':>9}{'depth':>6}"
        f"{'op us':>8}{'late':>7}{'fence':>7}{'prep':>6}{'react':>7}  cpu us/step: plan submit dispatch rest other"
        "  loop stage  host: busy steal bound"
    )
    lines = [head]
    for r in rows:
        cost = f"{r['op_us']:g}us flat" if r["op_us"] is not None else r["cost"]
        i, c = r["idle_us_per_op"], r["sched_cpu_us_per_step"]
        lines.append(
            f"{r['family']:<7}{cost:<18}{r['width']:>4} {_consumer(r):<11}{'on' if r['fuse_loop_head'] else 'off':<6}"
            f"{r.get('transport', 'streams'):<8}{r['eta']:>6.3f}{r['of_ideal']:>9.3f}"
            f"{r['tokens_per_s']:>9.0f}{r['mean_depth']:>6.2f}{r['mean_loop_op_us']:>8.0f}"
            f"{i['op_arrived_late']:>7.0f}{i['fences']:>7.0f}{i['stage_preparation']:>6.0f}"
            f"{r['reaction_us']['p50']:>7.0f}  {c['plan']:6.0f} {c['submit']:6.0f} {c['dispatch']:6.0f} "
            f"{c['engine_other']:5.0f} {c['other_threads']:6.0f}  {r['loop_stage_cpu_us_per_op']:10.0f}"
            f"  {r['host']['busy']:10.2f} {r['host']['steal']:5.2f} {r['host']['eta_bound']:5.2f}"
        )
    split = [r for r in rows if r.get("reaction_split_us")]
    if split:  # (in-process points on rings)
        lines.append(
            "reaction split, p50 / mean us: stage reply, ring, to the engine thread, engine (plan + send); "
            "the engine's CPU to send a loop op"
        )
        for r in split:
            parts = "  ".join(
                f"{p['p50']:.0f} / {p['mean']:.0f}" if p else "-" for p in r["reaction_split_us"].values()
            )
            lines.append(f"{r['family']:<7}{r['op_us'] or r['cost']!s:<8}w{r['width']:<4} {parts}")
    return "\n".join(lines)


def write_outputs(summary: dict[str, Any], out: Path) -> list[Path]:
    """``hostpath.json`` and ``eta.png``: the loop stage's busy fraction against the loop op time, per family,
    width and consumer."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in summary.get("medians") or summary["points"]:  # (with rounds: each point's median)
        if r["op_us"] is None:
            continue
        fused = "fused" if r["fuse_loop_head"] else "head op"
        n = r.get("frontends", 0)
        fronts = f" {n} front end{'s' if n > 1 else ''}" if n else ""
        label = f"{r['family']} w{r['width']} {r['consumer']}{fronts} {fused} {r.get('transport', 'streams')}"
        xs, ys = series.setdefault(label, ([], []))
        xs.append(r["op_us"])
        ys.append(r["eta"]["median"] if isinstance(r["eta"], dict) else r["eta"])
    paths = [outputs.write_json(out, "hostpath", summary)]
    if series:
        paths.append(
            outputs.lines(
                out / "eta.png",
                "loop stage busy fraction on synthetic stages",
                series,
                "loop op time (µs)",
                "eta (modelled device time / wall)",
            )
        )
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cdb bench hostpath", description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=["ouro", "huginn"])
    p.add_argument("--op-us", nargs="+", type=float, default=[250, 500, 1000, 2000], help="loop op times (µs)")
    p.add_argument("--widths", nargs="+", type=int, default=[32, 64, 128])
    p.add_argument("--consumers", nargs="+", choices=CONSUMERS, default=["in-process", "api"])
    p.add_argument("--no-profiles", dest="profiles", action="store_false", help="skip the named profiles")
    p.add_argument(
        "--fuse-loop-head",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="Ouro's head in the loop op (engine option --fuse-loop-head); both: side by side",
    )
    p.add_argument(
        "--transport",
        nargs="+",
        choices=("rings", "streams"),
        default=["rings"],
        help="the stage data plane (CDB_STAGE_RINGS): shared-memory rings or the gRPC streams; both: side by side",
    )
    p.add_argument(
        "--frontends",
        nargs="+",
        type=int,
        default=[0],
        help="api, http: front-end processes (CDB_FRONTENDS; 0: the scheduler serves the API); several: side by side",
    )
    p.add_argument("--seconds", type=float, default=3.0, help="steady window per point")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds before the window (admission ramp)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every point this many times, interleaved (round by round); medians and ranges per point",
    )
    p.add_argument("--quick", action="store_true", help="ouro, 500 µs, width 64, both consumers, short windows")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, help="write hostpath.json and eta.png here")
    args = p.parse_args(argv)
    args.fuse_loop_head = [v == "on" for v in args.fuse_loop_head]
    if args.quick:
        args.families, args.op_us, args.widths, args.profiles = ["ouro"], [500.0], [64], False
        args.seconds, args.warmup = min(args.seconds, 1.5), min(args.warmup, 1.0)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    todo = [(r, point) for r in range(args.rounds) for point in points(args)]  # round by round: drift hits all alike
    rows = []
    for r, point in outputs.progress(todo, len(todo), "hostpath", enabled=not args.json):
        rows.append(run_point(point, args.warmup, args.seconds) | {"round": r})
    summary: dict[str, Any] = {"points": rows, "seconds": args.seconds, "warmup_s": args.warmup}
    summary["native_scheduler"] = cdb_scheduler.NATIVE
    if args.rounds > 1:
        summary["rounds"], summary["medians"] = args.rounds, medians(rows)
    text = _table(rows) + ("\n" + _median_table(summary["medians"]) if args.rounds > 1 else "")
    print(json.dumps(summary, indent=2) if args.json else text)
    if args.out:
        for path in write_outputs(summary, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
