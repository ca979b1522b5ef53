"""One point of ``cdb bench apicost``: a ``cdb serve`` tree under a closed-loop streaming load from another
process, the CPU each serving process spends per output token over a steady window, and (``Point.profile``) the
activities it spends it on, from a second window sampled by py-spy (sampling pauses the processes, so the CPU
figures come from the window without it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdb_bench.apicost import activities
from cdb_bench.hostpath.measure import scrape
from cdb_bench.processes import cpu_seconds, free_port, with_public_caps
from cdb_engine.config import EngineConfig, Speculative
from cdb_model.loader import load_config
from cdb_scheduler.config import Mode
from services.launcher import ServeHandle, serve_all


@dataclass(frozen=True, slots=True)
class Point:
    """What one run serves and how it is loaded."""

    model: str
    mode: str
    api: str  # http | grpc
    concurrency: int
    synthetic_cost: str = ""
    speculative: str = "auto"
    frontends: str = ""  # CDB_FRONTENDS ("": the default, auto)
    max_num_seqs: int = 64
    prompt_tokens: int = 64
    output_tokens: int = 96
    client: str = "own"  # own | guidellm

    def label(self) -> str:
        fe = f" fe{self.frontends}" if self.frontends else ""
        spec = f" spec-{self.speculative}" if self.speculative != "auto" else ""
        return f"{self.mode} {self.api} c{self.concurrency}{fe}{spec}"


@dataclass(frozen=True, slots=True)
class Window:
    warmup_s: float
    seconds: float
    profile: bool
    pyspy: str
    guidellm: str
    seed: int = 0


def engine_config(point: Point) -> EngineConfig:
    return EngineConfig(
        model=point.model,
        mode=Mode(point.mode),
        synthetic_cost=point.synthetic_cost,
        speculative=Speculative(point.speculative),
        max_num_seqs=point.max_num_seqs,
    )


def serving_pids(tree: ServeHandle) -> dict[str, int]:
    """The serving processes of ``tree`` by role (the launcher's own process does no serving work)."""
    assert tree.scheduler is not None
    pids = {"scheduler": tree.scheduler.pid}
    pids.update({f"frontend-{i}": p.pid for i, p in enumerate(tree.frontends)})
    pids.update({f"stage-{stage.name.lower()}": p.pid for stage, p in tree.stages.items()})
    return pids


def _start_load(point: Point, window: Window, address: str, http: str, vocab: int) -> subprocess.Popen[Any]:
    seconds = window.warmup_s + window.seconds * (2 if window.profile else 1) + 30
    if point.client == "guidellm":
        argv = _guidellm_argv(point, window, http, seconds)
        # (its own session: it runs worker processes, stopped with it)
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    where = http if point.api == "http" else address
    argv = [sys.executable, "-m", "cdb_bench.apicost.load", point.api, where, point.model, str(point.concurrency)]
    argv += [str(point.prompt_tokens), str(point.output_tokens), str(seconds), str(vocab), str(window.seed)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the load did not start (exit {proc.wait()})")
    return proc


def _guidellm_argv(point: Point, window: Window, http: str, seconds: float) -> list[str]:
    """GuideLLM (0.8) as the load: ``concurrent`` streams of synthetic text prompts of the point's lengths through
    ``/v1/completions``, the shipped model's tokenizer read from its folder (no hub)."""
    backend = f"kind=openai_http,target=http://{http},model={point.model},request_format=/v1/completions"
    data = f"kind=synthetic_text,prompt_tokens={point.prompt_tokens},output_tokens={point.output_tokens}"
    report = Path(tempfile.mkdtemp(prefix="cdb-guidellm-")) / "report.json"
    return [
        *(window.guidellm, "run", "--backend", backend),
        *("--profile", f"kind=concurrent,streams={point.concurrency}"),
        *("--constraint", f"kind=max_duration,seconds={round(seconds)}", "--data", data),
        *("--tokenizer", f"kind=huggingface_auto,model={_tokenizer_folder(point.model)}"),
        *("--output", f"kind=json,path={report}", "--disable-console-interactive"),
    ]


def _wait_for_tokens(url: str, load: subprocess.Popen[Any], timeout: float = 120.0) -> None:
    """Until the tree reports generated tokens (a load that starts slowly, as GuideLLM does, is not timed)."""
    deadline = time.monotonic() + timeout
    while scrape(url).get("cdb_generation_tokens_total", 0.0) <= 0.0:
        if load.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the load generated nothing (exit {load.poll()})")
        time.sleep(0.2)


def _group_cpu(pid: int) -> float:
    """CPU seconds of the load's processes: ``pid`` and, when it leads a process group (GuideLLM and its
    workers), every process of that group."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if int(entry) == pid or os.getpgid(int(entry)) == pid:
                    total += cpu_seconds(int(entry))
    return total


def _stop(load: subprocess.Popen[Any]) -> None:
    """Stop the load and every process it started."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(load.pid) == load.pid:
            os.killpg(load.pid, signal.SIGKILL)
        else:
            load.kill()
    load.wait()


def _tokenizer_folder(model: str) -> str:
    from cdb_model.loader import resolve_source

    return resolve_source(model)


def _reading(url: str, pids: dict[str, int]) -> dict[str, Any]:
    m = scrape(url)
    return {
        "t": time.perf_counter(),
        "tokens": m.get("cdb_generation_tokens_total", 0.0),
        "loop_steps": m.get("cdb_loop_steps_total", 0.0),
        "cpu": {name: cpu_seconds(pid) for name, pid in pids.items()},
    }


def figures(a: dict[str, Any], b: dict[str, Any], point: Point) -> dict[str, Any]:
    """Tokens per second, served depth and CPU per output token (µs) of each process between readings."""
    tokens = max(1.0, b["tokens"] - a["tokens"])
    cpu = {name: 1e6 * (b["cpu"][name] - a["cpu"][name]) / tokens for name in a["cpu"]}
    return {
        "point": point.label(),
        "tokens_per_s": tokens / (b["t"] - a["t"]),
        "mean_depth": (b["loop_steps"] - a["loop_steps"]) / tokens,
        "cpu_us_per_token": cpu,
        "serving_cpu_us_per_token": sum(cpu.values()),
        "cpu_scale": 1e6 / tokens,
    }


def run_point(point: Point, window: Window) -> dict[str, Any]:
    """Serve, load, read (and sample); the point's figures (``figures``; ``activities``: per process, µs per
    token per activity, when sampled)."""
    cfg = engine_config(point)
    metrics_port, http = free_port(), f"127.0.0.1:{free_port()}"
    env = with_public_caps({**os.environ, "CDB_HTTP_ADDR": http}, 4 * point.concurrency)
    if point.frontends:
        env["CDB_FRONTENDS"] = point.frontends
    vocab = load_config(cfg.model).vocab_size  # (the model's config alone: no engine is built here)
    with serve_all(cfg, "127.0.0.1:0", env=env, metrics_listen=f"127.0.0.1:{metrics_port}") as tree:
        url, pids = f"http://127.0.0.1:{metrics_port}/metrics", serving_pids(tree)
        load = _start_load(point, window, tree.address, http, vocab)
        try:
            _wait_for_tokens(url, load)
            time.sleep(window.warmup_s)
            a, client_a = _reading(url, pids), _group_cpu(load.pid)
            time.sleep(window.seconds)
            fig = figures(a, _reading(url, pids), point)
            fig["client_cpu_us_per_token"] = (_group_cpu(load.pid) - client_a) * fig["cpu_scale"]
            del fig["cpu_scale"]
            if window.profile:
                fig["activities"] = _sampled(pids, window, fig["cpu_us_per_token"])
            if load.poll() is not None and load.returncode != 0:
                raise RuntimeError(f"the load exited with {load.returncode} during the window")
        finally:
            _stop(load)
    return fig


def _sampled(pids: dict[str, int], window: Window, cpu: dict[str, float]) -> dict[str, dict[str, float]]:
    """µs per token per activity of each process: the activities' shares of its CPU in the sampled window
    (``activities.split``) applied to its CPU per token in the window without sampling."""
    with tempfile.TemporaryDirectory(prefix="cdb-apicost-") as folder:
        before = {name: activities.thread_cpu(pid) for name, pid in pids.items()}
        raws = activities.record(pids, window.seconds, Path(folder), window.pyspy)
        out = {}
        for name, path in raws.items():
            after = activities.thread_cpu(pids[name])
            used = {tid: t - before[name].get(tid, 0.0) for tid, t in after.items()}
            with open(path) as f:
                shares = activities.split(f, used)
            out[name] = {a: share * cpu[name] for a, share in shares.items()}
    return out
