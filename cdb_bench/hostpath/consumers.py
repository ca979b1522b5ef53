"""The consumers of ``cdb bench hostpath``'s tokens: in this process (the scheduler as an ``Engine`` over the
stages, a closed loop of requests), or through the public API (gRPC or HTTP) by streaming clients in a child
process. Each returns the figures of its steady window."""

from __future__ import annotations

import gc
import os
import random
import time
from typing import Any

from cdb_bench.hostpath.measure import GcPauses, cpu_self, figures, host_cpu, scrape, steady_window
from cdb_bench.hostpath.points import (
    OUTPUT_LEN,
    PROMPT_LEN,
    Point,
    concurrency,
    engine_config,
    random_prompt,
    request_params,
)
from cdb_bench.processes import cpu_seconds, free_port, start_python
from cdb_engine.engine import Engine, StageSetup
from cdb_engine.events import Event, FinishEvent, TokenEvent
from cdb_scheduler.plan import Stage
from services import heap
from services.launcher import ServeHandle, serve_all
from services.telemetry.probe import HopLog
from services.transport.executor import GrpcExecutor, GrpcExecutorFactory


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
            prompt = random_prompt(self.rng, self.vocab)
            self.engine.submit(prompt, request_params(self.rng), self._sink, force=True, detokenize=False)

    def _sink(self, ev: Event) -> None:
        if isinstance(ev, TokenEvent):
            self.tokens += 1
        elif isinstance(ev, FinishEvent):
            self._submit()


def run_in_process(point: Point, tree: ServeHandle, warmup_s: float, seconds: float, seed: int) -> dict[str, Any]:
    cfg = engine_config(point)
    factory = GrpcExecutorFactory(tree.stage_addrs, tree.settings)
    hops = HopLog()

    def executor(setup: StageSetup) -> GrpcExecutor:
        ex = factory(setup)
        ex.probe = hops  # the reaction's hand-overs, timed (``reaction_split``)
        return ex

    engine = Engine(cfg, executor).start()
    heap.settle()  # as the scheduler's process does once started (``run_scheduler``)
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    try:
        loop = _ClosedLoop(engine, concurrency(point.width), seed)
        marks = []
        for _ in steady_window(warmup_s, seconds):
            st, cpu = engine.sched_stats, engine.cpu
            marks.append(
                {
                    "t": time.perf_counter_ns(),
                    "tokens": loop.tokens,
                    "loop_ops": st.ops[Stage.LOOP],
                    "cpu_process": cpu_self(),
                    "cpu_plan": st.sched_cpu_s,
                    "cpu_submit": cpu.submit_s,
                    "cpu_dispatch": cpu.dispatch_s,
                    "cpu_thread": cpu.thread_s,
                    "loop_stage_cpu_s": cpu_seconds(tree.stages[Stage.LOOP].pid),
                    "mean_depth": st.mean_depth,
                }
                | host_cpu()
            )
        loop.stopping = True
    finally:
        gc.callbacks.remove(pauses)
        engine.shutdown()
    a, b = marks
    return figures(a, b) | {"mean_depth": b["mean_depth"], "hops": hops, "gc": pauses.within(a["t"], b["t"])}


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
    cfg = engine_config(point)
    metrics_port = free_port()
    env = {**os.environ, "CDB_STAGE_OP_LOG": op_log, "CDB_STAGE_RINGS": str(point.transport == "rings").lower()}
    env["CDB_FRONTENDS"] = str(point.frontends)
    http = f"127.0.0.1:{free_port()}" if point.consumer == "http" else ""
    env["CDB_HTTP_ADDR"] = http
    with serve_all(cfg, "127.0.0.1:0", env=env, metrics_listen=f"127.0.0.1:{metrics_port}") as tree:
        assert tree.scheduler is not None
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        vocab = Engine(cfg).model_config.vocab_size
        where = ["http", http] if http else ["grpc", tree.address]
        argv = [*where, cfg.model, str(warmup_s + seconds + 60), str(concurrency(point.width)), str(seed)]
        argv += [str(vocab), str(PROMPT_LEN), str(OUTPUT_LEN[0]), str(OUTPUT_LEN[1])]
        client, _ = start_python(["-c", _CLIENT, *argv], env=_no_pin(dict(os.environ)))  # (its line: connected)
        try:
            marks = []
            for _ in steady_window(warmup_s, seconds):
                m = scrape(url)
                marks.append(
                    {
                        "t": time.perf_counter_ns(),
                        "tokens": m.get("cdb_generation_tokens_total", 0.0),
                        "loop_ops": m.get("loop_ops", 0.0),
                        "cpu_process": cpu_seconds(tree.scheduler.pid),
                        "cpu_plan": m.get("cpu_plan", 0.0),
                        "cpu_submit": m.get("cpu_submit", 0.0),
                        "cpu_dispatch": m.get("cpu_dispatch", 0.0),
                        "cpu_thread": sum(m.get(f"cpu_{p}", 0.0) for p in ("plan", "submit", "dispatch", "other")),
                        "frontends_cpu_s": sum(cpu_seconds(p.pid) for p in tree.frontends),
                        "loop_stage_cpu_s": cpu_seconds(tree.stages[Stage.LOOP].pid),
                    }
                    | host_cpu()
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
    fig = figures(a, b) | {"mean_depth": mean_depth}
    if point.frontends:  # the front ends' CPU per streamed token, and tokens streamed per second of their CPU
        tokens, cpu = b["tokens"] - a["tokens"], b["frontends_cpu_s"] - a["frontends_cpu_s"]
        fig["frontends_cpu_us_per_token"] = 1e6 * cpu / max(1.0, tokens)
        fig["tokens_per_frontend_core_s"] = tokens / max(1e-9, cpu)
    return fig


def _no_pin(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != "CDB_STAGE_OP_LOG"}
