"""``cdb bench serve --base-url URL``: the open-loop benchmark against a server this command did not start (a cdb
started with ``cdb serve``, or any OpenAI-compatible server), so that one tool measures cdb and its peers alike.

The same driver (``driver.drive``: scheduled arrivals, the client's lag, ``--max-concurrency``) and the same
figures (``metrics.summarize_run``) as against the targets this command starts, over HTTP
(``openai_target``); every run also carries the vLLM-named figures (``vllm_fields``). Requests: a data set file
(``--dataset-path``, ``datasets``) or the length fits with random token ids from the tokenizer's vocabulary. There
are no modes and no knee: each rate of ``--rates`` is one run, after one warm-up round that also checks the
server answers (a wrong model name or API key fails there, with the server's message).

The result: ``backend`` (``openai`` or ``openai-chat``), ``base_url``, ``endpoint``, ``model_id``,
``tokenizer_id``, ``date``, ``config`` (every option but the API key), ``workload``, ``runs[]`` (per rate: the
figures of ``report``'s runs and the vLLM-named ones, ``queue`` when the server exposes queue gauges, no ``ops``);
with one rate its vLLM-named figures are also at the top level, so the object reads as a vLLM result file.
``--out DIR`` writes ``serve.json`` (with every request's ITLs), ``summary.json`` (without per-request lists) and
one flat ``result-RATE.json`` per rate (the header and that run's figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cdb_bench.serve.datasets import describe_prompts, load_prompts
from cdb_bench.serve.driver import drive
from cdb_bench.serve.lengths import DATASETS
from cdb_bench.serve.metrics import RequestRecord, Slo, itl_lists
from cdb_bench.serve.openai_target import OpenAIConnection, OpenAIServer, list_models
from cdb_bench.serve.requests import RequestSet, ServeRequest, make_requests, requests_from, warmup_requests
from cdb_bench.serve.vllm_fields import field_names, percentile_key, run_figures
from cdb_model.config import CheckpointError
from cdb_model.loader import load_tokenizer
from cdb_model.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, HFTokenizer, Tokenizer

# the options that shape a --base-url run (the others configure the targets this command starts)
REMOTE_OPTIONS = (
    "base_url",
    "endpoint",
    "model",
    "tokenizer",
    "dataset",
    "dataset_path",
    "output_len",
    "scale",
    "requests",
    "rates",
    "arrival",
    "cv",
    "max_concurrency",
    "percentiles",
    "ignore_eos",
    "slo_ttft",
    "slo_tpot",
    "warmup",
    "sample_interval",
    "request_timeout",
    "seed",
)


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    rates: tuple[float, ...]
    slo: Slo
    percentiles: tuple[float, ...] = (50, 90, 99)
    max_concurrency: int | None = None
    burstiness: float = 1.0  # the gamma shape of the arrivals (1: Poisson), for the vLLM-named figures
    warmup: int = 1
    sample_interval: float = 0.1
    progress: bool = True


def open_tokenizer(source: str) -> Tokenizer:
    """A tokenizer to count tokens with: a ``tokenizer.json`` file, a folder with tokenizer files, or what
    ``load_tokenizer`` opens (presets, checkpoint folders, shipped models)."""
    path = Path(source)
    if path.is_file():
        return HFTokenizer(path)
    if path.is_dir() and (path / TOKENIZER_CONFIG).is_file():
        return HFTokenizer(path)
    if path.is_dir() and (path / TOKENIZER_JSON).is_file():
        return HFTokenizer(path / TOKENIZER_JSON)
    return load_tokenizer(source)


async def _session(
    server: OpenAIServer, requests: Sequence[ServeRequest], rc: RemoteConfig, on_done: Callable[[], None] | None
) -> tuple[list[RequestRecord], list[tuple[float, int, int]]]:
    conn = OpenAIConnection(server)
    try:
        interval = rc.sample_interval if await conn.probe_queue() else None
        return await drive(
            conn, requests, sample_interval=interval, on_done=on_done, max_concurrency=rc.max_concurrency
        )
    finally:
        await conn.close()


def measure(
    server: OpenAIServer, requests: Sequence[ServeRequest], rate: float, rc: RemoteConfig
) -> tuple[dict[str, Any], list[list[float]]]:
    """One run at ``rate``: its figures (``summarize_run``, ``queue``, the vLLM-named ones) and its ITL lists."""
    label = f"{server.model} @ {rate:.4g} req/s"
    bar = tqdm(total=len(requests), desc=label, unit="req", leave=False, disable=not rc.progress, file=sys.stderr)
    try:
        records, samples = asyncio.run(_session(server, requests, rc, lambda: bar.update(1)))
    finally:
        bar.close()
    run = run_figures(records, samples, rate, rc)
    run["rate"] = run["request_rate"]  # "inf" rather than a float JSON cannot hold
    return run, itl_lists(records)


def warm_up(server: OpenAIServer, requests: Sequence[ServeRequest], rc: RemoteConfig) -> None:
    """Short requests, all at once; raises ``RuntimeError`` with the server's answer if every one failed."""
    if not requests:
        return
    records, _ = asyncio.run(_session(server, requests, rc, None))
    if not any(r.ok for r in records):
        raise RuntimeError(f"{server.root}{server.endpoint} failed the warm-up: {records[0].error}")


def workload(args: argparse.Namespace, tok: Tokenizer | None, max_model_len: int | None) -> tuple[RequestSet, dict]:
    """The requests the options describe and the ``workload`` part of the result."""
    common = {"arrival": str(args.arrival), "cv": args.cv if args.arrival == "gamma" else 1.0, "seed": args.seed}
    max_total = max_model_len or 2**31
    if args.dataset_path:
        prompts, distinct = load_prompts(
            args.dataset_path,
            args.requests,
            tokenizer=tok,
            output_len=args.output_len,
            max_input=max_total - 1,
            max_total=max_total,
            seed=args.seed,
        )
        reqs = requests_from(
            [p.as_tuple() for p in prompts], depth=None, arrival=args.arrival, cv=args.cv, seed=args.seed
        )
        return reqs, describe_prompts(prompts, distinct, args.dataset_path) | common
    if tok is None:
        raise ValueError(
            "random prompts are drawn from the tokenizer's vocabulary: pass --tokenizer (or --dataset-path)"
        )
    fit = DATASETS[args.dataset]
    reqs = make_requests(
        fit,
        args.requests,
        vocab=tok.vocab_size,
        scale=args.scale,
        max_input=min(fit.prompt.hi, max_total - 1),
        max_total=min(fit.prompt.hi + fit.output.hi, max_total),
        depth=None,
        arrival=args.arrival,
        cv=args.cv,
        seed=args.seed,
    )
    n = len(reqs.requests)
    return reqs, {
        "dataset": args.dataset,
        "scale": args.scale,
        "requests": n,
        "mean_prompt_tokens": sum(r.prompt_len for r in reqs.requests) / n,
        "mean_output_tokens": reqs.output_tokens / n,
    } | common


def run_remote(args: argparse.Namespace) -> dict[str, Any]:
    """The whole ``--base-url`` benchmark (see the module docstring); returns the result (with ITL lists under
    ``runs[].per_request.itl_s``)."""
    if args.endpoint == "/v1/chat/completions" and not args.dataset_path:
        raise ValueError("the chat endpoint sends text prompts: pass --dataset-path")
    root = OpenAIServer.root_of(args.base_url)
    cards = list_models(root, args.api_key)
    card = next((c for c in cards if c.get("id") == args.model), cards[0])
    model = args.model or str(card["id"])
    max_len = card.get("max_model_len") if card.get("id") == model else None
    tok_source = args.tokenizer or model
    tok: Tokenizer | None = None
    try:
        tok = open_tokenizer(tok_source)
    except (CheckpointError, OSError, ValueError, KeyError):
        if args.tokenizer:
            raise
    server = OpenAIServer(root, args.endpoint, model, args.api_key, args.request_timeout, args.ignore_eos)
    reqs, work = workload(args, tok, max_len if isinstance(max_len, int) else None)
    rc = RemoteConfig(
        rates=args.rates,
        slo=Slo(args.slo_ttft, args.slo_tpot),
        percentiles=args.percentiles,
        max_concurrency=args.max_concurrency,
        burstiness=1.0 / (args.cv * args.cv) if args.arrival == "gamma" else 1.0,
        warmup=args.warmup,
        sample_interval=args.sample_interval,
        progress=not args.no_progress,
    )
    warm_up(server, warmup_requests(reqs, rc.warmup), rc)
    runs = []
    for rate in rc.rates:
        run, itls = measure(server, reqs.at(rate), rate, rc)
        run["per_request"]["itl_s"] = itls
        runs.append(run)
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k in REMOTE_OPTIONS}
    config |= {"api_key_set": bool(args.api_key), "arrival": str(args.arrival), "model": model}
    config["rates"] = [r if math.isfinite(r) else "inf" for r in args.rates]
    out: dict[str, Any] = {
        "backend": "openai-chat" if args.endpoint.endswith("/chat/completions") else "openai",
        "base_url": root,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": tok_source if tok is not None else None,
        "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        "config": config,
        "workload": work,
        "runs": runs,
    }
    if len(runs) == 1:
        out |= {k: runs[0][k] for k in field_names(rc.percentiles)}
    return out


def slim(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` without per-request lists and queue samples."""
    runs = [
        {k: v for k, v in r.items() if k != "per_request"}
        | {"queue": {k: v for k, v in r["queue"].items() if k != "samples"}}
        for r in result["runs"]
    ]
    return result | {"runs": runs}


def write_remote(result: dict[str, Any], out_dir: str) -> list[Path]:
    """``serve.json``, ``summary.json`` and one ``result-RATE.json`` per run under ``out_dir``."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / "serve.json", d / "summary.json"]
    paths[0].write_text(json.dumps(result, indent=1))
    small = slim(result)
    paths[1].write_text(json.dumps(small, indent=1))
    head = {k: v for k, v in small.items() if k not in ("runs", "config", "workload")}
    for run in small["runs"]:
        path = d / f"result-{run['rate']:g}.json" if run["rate"] != "inf" else d / "result-inf.json"
        path.write_text(json.dumps(head | run, indent=1))
        paths.append(path)
    return paths


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def remote_table(result: dict[str, Any], percentiles: Sequence[float]) -> str:
    """One block per run: counts, throughputs, then TTFT / TPOT / ITL / E2E (ms, from the send) with the
    percentiles asked for; the latencies from the scheduled arrival and the client's lag below."""
    w = result["workload"]
    lines = [
        f"{result['base_url']}{result['endpoint']}  model {result['model_id']}  {w['requests']} requests  "
        f"{w.get('dataset_path') or str(w['dataset']) + '-like lengths'}  {w['arrival']} arrivals",
    ]
    names = {
        "ttft": "time to first token",
        "tpot": "time per output token",
        "itl": "inter-token latency",
        "e2el": "end-to-end latency",
    }
    for run in result["runs"]:
        cap = run["max_concurrency"] if run["max_concurrency"] is not None else "none"
        lines += [
            "",
            f"rate {run['request_rate']} req/s  (max concurrency {cap}, "
            f"peak in flight {run['max_concurrent_requests']})",
            f"  completed {run['completed']} / {run['num_prompts']}  in {run['duration']:.2f} s"
            + (f"  errors: {'; '.join(run['errors'])}" if run["errors"] else ""),
            f"  tokens in {run['total_input_tokens']}, out {run['total_output_tokens']}  throughput "
            f"{run['request_throughput']:.2f} req/s, {run['output_throughput']:.1f} output tok/s, "
            f"{run['total_token_throughput']:.1f} total tok/s, goodput {run['request_goodput']:.2f} req/s",
        ]
        for m, text in names.items():
            pcts = "  ".join(f"{percentile_key(p)} {run[f'{percentile_key(p)}_{m}_ms']:.2f}" for p in percentiles)
            lines.append(
                f"  {text + ' (ms)':<28} mean {run[f'mean_{m}_ms']:.2f}  median {run[f'median_{m}_ms']:.2f}  "
                f"std {run[f'std_{m}_ms']:.2f}  {pcts}"
            )
        t, e, lag = run["ttft_s"], run["e2e_s"], run["client_lag"]
        lines.append(
            f"  from the scheduled arrival: TTFT mean {_ms(t['mean'])} p99 {_ms(t['p99'])}, E2E mean "
            f"{_ms(e['mean'])} p99 {_ms(e['p99'])} ms; client lag p99 {_ms(lag['p99_s'])} ms"
            + (f"; mean depth {run['mean_depth']:.2f}" if run["mean_depth"] is not None else "")
        )
    return "\n".join(lines)
