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
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cdb_bench.serve.arrivals import Arrival
from cdb_bench.serve.lengths import DATASETS
from cdb_bench.serve.metrics import Slo
from cdb_bench.serve.report import table, write_outputs
from cdb_bench.serve.requests import RequestSet, make_requests
from cdb_bench.serve.sweep import SweepConfig, run_sweep
from cdb_bench.serve.targets import TARGETS
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine
from cdb_scheduler.config import Mode

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


def positive_floats(text: str) -> tuple[float, ...]:
    """``--rates 1,2,4``-style options: comma-separated positive numbers (argparse ``type``)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def parse_with_quick(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    quick: Mapping[str, Any],
    converters: Mapping[str, Callable[[str], Any]],
) -> argparse.Namespace:
    """Parse ``argv``; ``--quick`` swaps in the ``quick`` defaults only, so options given explicitly still win;
    options still holding a string default are run through their ``converters`` (argparse leaves defaults as they
    are)."""
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    for name, convert in converters.items():
        value = getattr(args, name)
        if isinstance(value, str):
            setattr(args, name, convert(value))
    return args


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in {x.value for x in Mode}]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes must be among {', '.join(x.value for x in Mode)}; got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdb bench serve", description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("--target", choices=TARGETS, default="deployment")
    p.add_argument("--modes", type=_modes, default="cdb,no-refill,full-depth")
    p.add_argument("--model", default="ouro-bench", help="preset name or checkpoint folder")
    p.add_argument("--dataset", choices=sorted(DATASETS), default="sharegpt", help="length distribution")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length (e.g. 0.1 on a CPU)")
    p.add_argument("--requests", type=int, default=200, help="requests per rate")
    p.add_argument("--rates", type=positive_floats, default="1,2,4,8", help="comma-separated request rates (req/s)")
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
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="in-process: torch intra-op threads")
    p.add_argument("--sample-interval", type=float, default=0.1, help="queue counters every this many seconds")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deployment: deadline of each call (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick", action="store_true", help="a tiny run for CI: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", default=None, help="write serve.json and PNG plots here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options; ``--quick`` changes the defaults only, so options given explicitly still win."""
    parser = build_parser()
    args = parse_with_quick(parser, argv, QUICK, {"rates": positive_floats, "modes": _modes})
    if args.requests < 1 or args.scale <= 0 or args.bisect < 0 or args.cv <= 0 or args.latency_bound <= 0:
        parser.error("--requests >= 1, --scale > 0, --bisect >= 0, --cv > 0 and --latency-bound > 0 are required")
    if args.repeats < 1:
        parser.error(f"--repeats: at least 1, got {args.repeats}")
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks,
        kv_policy=args.kv_policy,
        min_head_batch_size=args.min_head,
        num_threads=args.threads,
        fuse_refill_embed=args.fuse_refill_embed,
        allow_replay_depths=True,
    )


def workload(args: argparse.Namespace, probe: Engine) -> tuple[RequestSet, tuple[float, int, int] | None]:
    """The seeded request set the options describe, and its replayed-depth distribution (None: live)."""
    depth = None
    if not args.live:
        hi = args.depth_max or probe.limits.max_depth
        mean = args.depth_mean if args.depth_mean is not None else (args.depth_min + hi) / 2
        depth = (mean, args.depth_min, hi)
    reqs = make_requests(
        DATASETS[args.dataset],
        args.requests,
        vocab=probe.model_config.vocab_size,
        scale=args.scale,
        max_input=probe.limits.max_input_tokens,
        max_total=probe.limits.max_total_tokens,
        depth=depth,
        arrival=args.arrival,
        cv=args.cv,
        seed=args.seed,
    )
    return reqs, depth


def header(args: argparse.Namespace, probe: Engine, reqs: RequestSet, depth: tuple[float, int, int] | None) -> dict:
    """The ``config``, ``model`` and ``workload`` parts of the result."""
    fit = DATASETS[args.dataset]
    f0, fr = probe.model_config.param_counts()
    n = len(reqs.requests)
    skip = {"quick", "json", "out", "no_progress"}
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k not in skip}
    config |= {"slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot, "latency_bound_s": args.latency_bound}
    config |= {"quick": args.quick, "arrival": str(args.arrival)}
    return {
        "config": config,
        "model": {
            "name": args.model,
            "arch": probe.model_config.arch,
            "max_depth": probe.limits.max_depth,
            "vocab_size": probe.model_config.vocab_size,
            "max_input_tokens": probe.limits.max_input_tokens,
            "max_total_tokens": probe.limits.max_total_tokens,
            "F0_over_Fr": f0 / fr,
        },
        "workload": {
            "dataset": args.dataset,
            "fit": {"source": fit.source, "prompt": _fit(fit.prompt), "output": _fit(fit.output)},
            "scale": args.scale,
            "requests": n,
            "mean_prompt_tokens": sum(r.prompt_len for r in reqs.requests) / n,
            "mean_output_tokens": reqs.output_tokens / n,
            "arrival": str(args.arrival),
            "cv": args.cv if args.arrival is Arrival.GAMMA else 1.0,
            "seed": args.seed,
            "depth": None if depth is None else {"mean": depth[0], "min": depth[1], "max": depth[2]},
        },
    }


def _fit(f: Any) -> dict[str, float]:
    return {"mu": f.mu, "sigma": f.sigma, "lo": f.lo, "hi": f.hi, "target_mean": f.target_mean}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    )
    figures, itls = run_sweep(cfg, reqs, sc)
    summary = header(args, probe, reqs, depth) | figures
    if args.out:
        for path in write_outputs(summary, itls, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(summary, indent=1) if args.json else table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
