"""``cdb bench serve``: an open-loop serving benchmark (rate sweep, latency percentiles, goodput, capacity knee).

    cdb bench serve --quick --target in-process
    cdb bench serve --model ouro-bench --dataset sharegpt --scale 0.1 --rates 2,4,8,16 --bisect 3 --out serve-out

Seeded arrivals (Poisson, or a bursty gamma process with ``--cv``), ShareGPT- or Alpaca-like lengths
(``cdb_bench.serve.lengths``) and replayed per-token depths (or ``--live`` exit decisions) are drawn once from the
seed, so every mode serves the same requests at every rate. ``--target deployment`` (default) drives a fresh
process tree per mode through the public gRPC API; ``--target in-process`` drives an engine in this process.
Reports per mode and rate: output and request throughput, goodput under the SLO, TTFT / TPOT / ITL / E2E /
normalized latency (mean, p50, p90, p99), queue length over time, the client's lag; per mode the capacity knee
(highest rate with mean normalized latency under ``--latency-bound``); the knee ratio cdb / full-depth and the
normalized-latency cut of each mode at full depth's knee rate.

    cdb bench serve --base-url http://127.0.0.1:8000 --dataset-path sharegpt.json --tokenizer models/ouro-kjv \
        --request-rate 4 --max-concurrency 16 --percentiles 50,90,99 --out serve-out

``--base-url`` drives a server this command did not start (a ``cdb serve``, or any OpenAI-compatible server)
with the same driver and figures, over streamed HTTP completions (``cdb_bench.serve.remote``). Every run also
reports its figures under the names ``vllm bench serve`` uses (``cdb_bench.serve.vllm_fields``). ``--dataset-path``
takes prompts from a ShareGPT JSON or JSONL file instead of the length fits (``cdb_bench.serve.datasets``);
``--max-concurrency`` caps the requests in flight while arrivals stay scheduled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx2
import torch

from cdb_bench.serve.arrivals import Arrival
from cdb_bench.serve.datasets import DatasetError
from cdb_bench.serve.lengths import DATASETS
from cdb_bench.serve.metrics import Slo
from cdb_bench.serve.openai_target import ENDPOINTS
from cdb_bench.serve.options import modes, parse_with_quick, percentile_list, positive_floats
from cdb_bench.serve.prefix import (
    PREFIX_DATASET,
    check_prefix_options,
    compare_prefix_caching,
    compare_table,
    prefix_options,
)
from cdb_bench.serve.remote import remote_table, run_remote, write_remote
from cdb_bench.serve.report import table, write_outputs
from cdb_bench.serve.requests import RequestSet
from cdb_bench.serve.setup import engine_config, header, workload
from cdb_bench.serve.sweep import MODE_NAMES, SPECULATIVE, SweepConfig, run_sweep
from cdb_bench.serve.targets import TARGETS
from cdb_engine.engine import Engine
from cdb_model.config import CheckpointError

DEFAULT_MODEL = "ouro-bench"
QUICK: dict[str, Any] = {
    "model": "ouro-tiny",
    "requests": 8,
    "rates": "8,24",
    "scale": 0.1,
    "bisect": 0,
    "warmup": 2,
    "max_num_seqs": 8,
    "num_kv_blocks": 256,
    "latency_bound": 1.0,  # a loaded CI machine still finds every knee
}
REMOTE_QUICK = ("requests", "rates", "scale", "warmup")  # --quick with --base-url: the server is not ours to size


def _request_options(p: argparse.ArgumentParser) -> None:
    """What each mode serves: the model, the request set, the rates and the figures."""
    p.add_argument("--target", choices=TARGETS, default="deployment")
    p.add_argument(
        "--modes",
        type=modes,
        default="cdb,no-refill,full-depth",
        help=f"among {', '.join(MODE_NAMES)} ({SPECULATIVE}: cdb with self-speculative decoding; the others without)",
    )
    p.add_argument("--speculative", action="store_true", help=f"add the mode {SPECULATIVE} beside the others")
    p.add_argument(
        "--model",
        default=None,
        help=f"preset name or checkpoint folder (default: {DEFAULT_MODEL}); with --base-url the model name the "
        "requests carry (default: the server's first model)",
    )
    p.add_argument(
        "--dataset",
        choices=[*sorted(DATASETS), PREFIX_DATASET],
        default="sharegpt",
        help=f"length distribution, or {PREFIX_DATASET}: shared prompt prefixes",
    )
    p.add_argument(
        "--dataset-path",
        default=None,
        help="prompts from this file instead of the length fits: ShareGPT JSON or JSONL {prompt, output_len}",
    )
    p.add_argument(
        "--output-len", type=int, default=None, help="--dataset-path: ask every request for this many tokens"
    )
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length (e.g. 0.1 on a CPU)")
    p.add_argument("--requests", "--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument(
        "--rates",
        "--request-rate",
        type=positive_floats,
        default="1,2,4,8",
        help="comma-separated request rates (req/s; inf: every request at once)",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight (arrivals stay put)"
    )
    p.add_argument(
        "--percentiles",
        type=percentile_list,
        default="50,90,99",
        help="the pNN_*_ms figures of the vLLM-named results",
    )


def _sweep_options(p: argparse.ArgumentParser) -> None:
    """Arrivals, depths, the SLO and the knee search."""
    p.add_argument("--arrival", type=Arrival, choices=list(Arrival), default=Arrival.POISSON)
    p.add_argument("--cv", type=float, default=2.0, help="gamma arrivals: coefficient of variation of the gaps")
    p.add_argument("--depth-mean", type=float, default=None, help="replayed depth mean (default: mid-range)")
    p.add_argument("--depth-min", type=int, default=1)
    p.add_argument("--depth-max", type=int, default=None, help="default: the model's max depth")
    p.add_argument("--live", action="store_true", help="no replay: the model's exit gate decides each depth")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO on TTFT (s)")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO on TPOT (s)")
    p.add_argument("--latency-bound", type=float, default=0.1, help="knee: mean normalized latency bound (s/token)")
    p.add_argument("--bisect", type=int, default=3, help="bisection steps of each mode's knee")
    p.add_argument("--warmup", type=int, default=4, help="short warm-up requests per mode before measuring")
    p.add_argument(
        "--repeats", type=int, default=1, help="run the whole sweep this many times (every mode each time): medians"
    )


def _engine_options(p: argparse.ArgumentParser) -> None:
    """The engine each mode runs, and the driver's sampling and deadline."""
    p.add_argument("--max-num-seqs", type=int, default=32, help="resident requests: the width of the loop batch")
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--kv-policy", default="single")
    p.add_argument("--min-head", type=int, default=None, help="min_head_batch_size (default: the model's)")
    p.add_argument(
        "--fuse-refill-embed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Ouro: the head op embeds each refill's input (no prelude op per decode step)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of cached prompt prefixes",
    )
    p.add_argument("--prefill-chunk-size", type=int, default=None, help="prompt tokens per prefill chunk")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="in-process: torch intra-op threads")
    p.add_argument(
        "--synthetic-cost",
        default="",
        metavar="SPEC",
        help="synthetic stages with this modelled device time (e.g. loop=5000:10:0 or h200:ouro-1.4b): the method "
        "at GPU-like op costs, its tokens meaningless (see cdb bench hostpath)",
    )
    p.add_argument(
        "--synthetic-depths",
        default="",
        metavar="MEAN:MIN[:ACCEPT]",
        help="--synthetic-cost: the stages' drawn exit depths (and drafts' agreement per loop step)",
    )
    p.add_argument("--sample-interval", type=float, default=0.1, help="queue counters every this many seconds")
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="deployment, --base-url: deadline of each call (s)"
    )


def _remote_options(p: argparse.ArgumentParser) -> None:
    """A server this command did not start, and how to talk to it."""
    remote = p.add_argument_group("against a running server (--base-url)")
    remote.add_argument(
        "--base-url",
        default=None,
        help="an OpenAI-compatible server to drive, e.g. http://127.0.0.1:8000 (a running cdb, or another server)",
    )
    remote.add_argument("--endpoint", choices=ENDPOINTS, default=ENDPOINTS[0], help="the streamed API called")
    remote.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    remote.add_argument(
        "--tokenizer",
        default=None,
        help="counts prompt and reference-answer tokens: a preset, checkpoint folder or tokenizer.json "
        "(default: --model, if it opens here)",
    )
    remote.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly max_tokens tokens (off for servers that refuse the field)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdb bench serve", description=__doc__.split("\n\n")[0] if __doc__ else "")
    _request_options(p)
    _sweep_options(p)
    _engine_options(p)
    _remote_options(p)
    prefix_options(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick", action="store_true", help="a tiny run for CI: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--out", default=None, help="write serve.json and PNG plots here (--base-url: result-RATE.json, no plots)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options; ``--quick`` changes the defaults only, so options given explicitly still win."""
    parser = build_parser()
    remote = parser.parse_args(argv).base_url is not None
    quick = {k: v for k, v in QUICK.items() if k in REMOTE_QUICK} if remote else QUICK
    converters = {"rates": positive_floats, "modes": modes, "percentiles": percentile_list}
    args = parse_with_quick(parser, argv, quick, converters)
    if args.requests < 1 or args.scale <= 0 or args.bisect < 0 or args.cv <= 0 or args.latency_bound <= 0:
        parser.error("--requests >= 1, --scale > 0, --bisect >= 0, --cv > 0 and --latency-bound > 0 are required")
    if args.repeats < 1:
        parser.error(f"--repeats: at least 1, got {args.repeats}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency: at least 1, got {args.max_concurrency}")
    if args.output_len is not None and args.output_len < 1:
        parser.error(f"--output-len: at least 1, got {args.output_len}")
    check_prefix_options(parser, args)
    if not remote:
        args.model = args.model or DEFAULT_MODEL
    if args.speculative and SPECULATIVE not in args.modes:
        args.modes = (*args.modes, SPECULATIVE)
    if SPECULATIVE in args.modes and args.kv_policy not in ("last_exited", "depth_indexed"):
        parser.error(
            f"mode {SPECULATIVE} needs --kv-policy last_exited (or depth_indexed): with {args.kv_policy} every loop "
            "step reads the previous token's final KV, so nothing can start early"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.base_url is not None:
        return remote_main(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = engine_config(args)
    probe = Engine(cfg)
    reqs, depth = workload(args, probe)
    sc = SweepConfig(
        target=args.target,
        modes=args.modes,
        rates=args.rates,
        slo=Slo(args.slo_ttft, args.slo_tpot),
        latency_bound=args.latency_bound,
        bisect=args.bisect,
        warmup=args.warmup,
        sample_interval=args.sample_interval,
        request_timeout=args.request_timeout,
        progress=not args.no_progress,
        repeats=args.repeats,
        max_concurrency=args.max_concurrency,
        percentiles=args.percentiles,
        burstiness=1.0 / (args.cv * args.cv) if args.arrival is Arrival.GAMMA else 1.0,
    )
    if args.compare_prefix_caching:
        return compare_main(args, probe, reqs, depth, sc)
    figures, itls = run_sweep(cfg, reqs, sc)
    summary = header(args, probe, reqs, depth) | figures
    if args.out:
        for path in write_outputs(summary, itls, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(summary, indent=1) if args.json else table(summary))
    return 0


def compare_main(
    args: argparse.Namespace, probe: Engine, reqs: RequestSet, depth: tuple[float, int, int] | None, sc: SweepConfig
) -> int:
    """``--compare-prefix-caching``: the same arrivals with the cache on and off (``cdb_bench.serve.prefix``)."""
    summary = header(args, probe, reqs, depth)
    summary["config"]["target"] = "in-process"
    summary["prefix_caching"] = compare_prefix_caching(engine_config(args), reqs, sc, args.rounds)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "serve.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(summary, indent=1) if args.json else compare_table(summary))
    return 0


def remote_main(args: argparse.Namespace) -> int:
    """``--base-url``: drive the server (``cdb_bench.serve.remote``); a server that cannot be reached or fails the
    warm-up, or an unusable data set file, is a one-line error (exit 1)."""
    try:
        result = run_remote(args)
    except (DatasetError, CheckpointError, RuntimeError, ValueError, OSError, httpx2.HTTPError) as exc:
        print(f"cdb bench serve: {exc}", file=sys.stderr)
        return 1
    if args.out:
        for path in write_remote(result, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(result, indent=1) if args.json else remote_table(result, args.percentiles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
