"""What a local ``cdb bench serve`` run is made of, from its options: the engine configuration, the seeded request
set, and the ``config`` / ``model`` / ``workload`` header of its result."""

from __future__ import annotations

import argparse
from typing import Any

from cdb_bench.serve.arrivals import Arrival
from cdb_bench.serve.datasets import load_prompts
from cdb_bench.serve.lengths import DATASETS
from cdb_bench.serve.prefix import PREFIX_DATASET, prefix_requests, prefix_workload
from cdb_bench.serve.requests import RequestSet, make_requests, requests_from
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine


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
        synthetic_cost=args.synthetic_cost,
        synthetic_depths=args.synthetic_depths,
        enable_prefix_caching=args.enable_prefix_caching,
        **({"prefill_chunk_size": args.prefill_chunk_size} if args.prefill_chunk_size else {}),
    )


def workload(args: argparse.Namespace, probe: Engine) -> tuple[RequestSet, tuple[float, int, int] | None]:
    """The seeded request set the options describe, and its replayed-depth distribution (None: live)."""
    depth = None
    if not args.live:
        hi = args.depth_max or probe.limits.max_depth
        mean = args.depth_mean if args.depth_mean is not None else (args.depth_min + hi) / 2
        depth = (mean, args.depth_min, hi)
    if args.dataset == PREFIX_DATASET:
        return prefix_requests(args, probe, depth), depth
    if args.dataset_path:
        prompts, _ = load_prompts(
            args.dataset_path,
            args.requests,
            tokenizer=probe.tokenizer,
            output_len=args.output_len,
            max_input=probe.limits.max_input_tokens,
            max_total=probe.limits.max_total_tokens,
            seed=args.seed,
        )
        tuples = [p.as_tuple() for p in prompts]
        return requests_from(tuples, depth=depth, arrival=args.arrival, cv=args.cv, seed=args.seed), depth
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
    fit = None if args.dataset_path else DATASETS.get(args.dataset)
    f0, fr = probe.model_config.param_counts()
    n = len(reqs.requests)
    skip = {"quick", "json", "out", "no_progress", "api_key"}
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
            "dataset": "file" if args.dataset_path else args.dataset,
            "dataset_path": args.dataset_path,
            "fit": None
            if fit is None
            else {"source": fit.source, "prompt": _fit(fit.prompt), "output": _fit(fit.output)},
            "scale": args.scale,
            "requests": n,
            "mean_prompt_tokens": sum(r.prompt_len for r in reqs.requests) / n,
            "mean_output_tokens": reqs.output_tokens / n,
            "arrival": str(args.arrival),
            "cv": args.cv if args.arrival is Arrival.GAMMA else 1.0,
            "seed": args.seed,
            "depth": None if depth is None else {"mean": depth[0], "min": depth[1], "max": depth[2]},
        }
        | (prefix_workload(args) if args.dataset == PREFIX_DATASET else {}),
    }


def _fit(f: Any) -> dict[str, float]:
    return {"mu": f.mu, "sigma": f.sigma, "lo": f.lo, "hi": f.hi, "target_mean": f.target_mean}
