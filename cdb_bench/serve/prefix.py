"""Shared prompt prefixes: ``--dataset prefix-repetition``, and ``--compare-prefix-caching`` (the cache on vs off).

``prefix-repetition`` (as vLLM's ``prefix_repetition``): ``--prefix-count`` N random prefixes of ``--prefix-len``
L tokens, each followed by ``--suffixes`` M suffixes of ``--suffix-len`` random tokens; the N x M requests (this
replaces ``--requests``) ask for ``--output-len`` tokens each (default 16) and arrive in a seeded random order.

``--compare-prefix-caching`` serves that request set in-process (the engine's counters say what hit) on two engines,
``enable_prefix_caching`` on and off, otherwise alike (the first of ``--modes``), at every rate of ``--rates``, in
``--rounds`` interleaved rounds (on first in odd rounds, off first in even ones). Every run has a fresh engine: its
cache starts empty, warmed up on the warm-up requests' prompts reversed (the same lengths, none of the prefixes).
Reports per rate and round the ratios on / off of TTFT p50 and p99 and of output throughput, their medians over
rounds, and the hit rate (prefix hits / prefix queries, tokens, from ``SchedulerStats``) of each run.

A request reuses the longest cached prefix that ends at a multiple of ``lcm(prefill_chunk_size, kv_block_size)``
(``cdb_scheduler.prefix_cache``): with the default 256-token chunks a 1,000-token prefix hits 768 tokens, with
``--prefill-chunk-size 64`` 960.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from dataclasses import replace
from typing import Any

from cdb_bench.serve.requests import RequestSet, ServeRequest, requests_from, warmup_requests
from cdb_bench.serve.sweep import SweepConfig, _session, measure, mode_config
from cdb_bench.serve.targets import InProcessTarget, open_target
from cdb_bench.stats import median
from cdb_engine.config import EngineConfig
from cdb_engine.engine import Engine
from cdb_engine.setup import torch_dtype
from cdb_model.loader import load_model

PREFIX_DATASET = "prefix-repetition"
DEFAULT_OUTPUT_LEN = 16
RATIOS = {  # name -> (run figure, statistic)
    "ttft_p50_on_over_off": ("ttft_s", "p50"),
    "ttft_p99_on_over_off": ("ttft_s", "p99"),
    "throughput_on_over_off": ("output_throughput", None),
}


def prefix_options(p: argparse.ArgumentParser) -> None:
    """The options of the shared-prefix workload and of the cache comparison."""
    g = p.add_argument_group(f"shared prefixes (--dataset {PREFIX_DATASET})")
    g.add_argument("--prefix-count", type=int, default=4, help="distinct prefixes")
    g.add_argument("--prefix-len", type=int, default=256, help="tokens per prefix")
    g.add_argument("--suffixes", type=int, default=8, help="requests (own suffixes) per prefix")
    g.add_argument("--suffix-len", type=int, default=32, help="tokens per suffix")
    g.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="in-process: the same arrivals with enable_prefix_caching on and off, in interleaved rounds (ratios)",
    )
    g.add_argument("--rounds", type=int, default=3, help="--compare-prefix-caching: rounds of on and off")


def check_prefix_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject impossible values; the request count becomes prefixes x suffixes."""
    if args.compare_prefix_caching and args.dataset != PREFIX_DATASET:
        parser.error(f"--compare-prefix-caching needs --dataset {PREFIX_DATASET}")
    if args.dataset != PREFIX_DATASET:
        return
    if args.base_url is not None or args.dataset_path:
        parser.error(f"--dataset {PREFIX_DATASET} runs locally, without --base-url or --dataset-path")
    if min(args.prefix_count, args.prefix_len, args.suffixes, args.suffix_len, args.rounds) < 1:
        parser.error("--prefix-count, --prefix-len, --suffixes, --suffix-len and --rounds: at least 1")
    args.requests = args.prefix_count * args.suffixes


def prefix_requests(args: argparse.Namespace, probe: Engine, depth: tuple[float, int, int] | None) -> RequestSet:
    """The N x M shared-prefix requests in a seeded random order (prompts drawn from seed + 2)."""
    out = args.output_len or DEFAULT_OUTPUT_LEN
    prompt_len = args.prefix_len + args.suffix_len
    lim = probe.limits
    if prompt_len > lim.max_input_tokens or prompt_len + out > lim.max_total_tokens:
        raise ValueError(
            f"prefix + suffix = {prompt_len} tokens (+ {out} out): the model takes at most {lim.max_input_tokens} "
            f"(and {lim.max_total_tokens} in all)"
        )
    rng = random.Random(args.seed + 2)
    vocab = probe.model_config.vocab_size

    def draw(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab) for _ in range(n))

    prefixes = [draw(args.prefix_len) for _ in range(args.prefix_count)]
    prompts = [(p + draw(args.suffix_len), prompt_len, out) for p in prefixes for _ in range(args.suffixes)]
    rng.shuffle(prompts)
    return requests_from(prompts, depth=depth, arrival=args.arrival, cv=args.cv, seed=args.seed)


def prefix_workload(args: argparse.Namespace) -> dict[str, Any]:
    """The shared-prefix part of the result's ``workload``."""
    return {
        "prefix_count": args.prefix_count,
        "prefix_len": args.prefix_len,
        "suffixes": args.suffixes,
        "suffix_len": args.suffix_len,
        "output_len": args.output_len or DEFAULT_OUTPUT_LEN,
    }


def _cold_warmup(reqs: RequestSet, k: int) -> list[ServeRequest]:
    """Warm-up requests whose prompts are reversed: the same shapes, none of the measured prefixes."""
    out = []
    for r in warmup_requests(reqs, k):
        assert not isinstance(r.prompt, str)
        out.append(replace(r, prompt=r.prompt[::-1]))
    return out


def _prefix_counters(target: InProcessTarget) -> tuple[int, int]:
    s = target.engine.sched_stats
    return s.prefix_queries, s.prefix_hits


def _one_run(
    cfg: EngineConfig, model: Any, reqs: RequestSet, rate: float, sc: SweepConfig, label: str
) -> dict[str, Any]:
    """A fresh in-process engine: the cold warm-up, then one measured run with its prefix counters."""
    n = len(reqs.requests)
    with open_target("in-process", cfg, model=model, max_live=n, timeout=sc.request_timeout) as t:
        assert isinstance(t, InProcessTarget)
        asyncio.run(_session(t, _cold_warmup(reqs, sc.warmup), sc, None))
        q0, h0 = _prefix_counters(t)
        run, _ = measure(t, reqs.at(rate), rate, sc, label)
        q1, h1 = _prefix_counters(t)
        cached = t.engine.scheduler.blocks.num_cached
    run.pop("per_request", None)
    queries, hits = q1 - q0, h1 - h0
    run["prefix_cache"] = {
        "enabled": cfg.enable_prefix_caching,
        "queries": queries,
        "hits": hits,
        "hit_rate": hits / queries if queries else 0.0,
        "cached_blocks": cached,
    }
    return run


def _ratio(on: dict[str, Any], off: dict[str, Any], key: str, stat: str | None) -> float | None:
    a, b = (r[key] if stat is None else r[key][stat] for r in (on, off))
    return a / b if a is not None and b else None


def _summarize_rate(on: list[dict[str, Any]], off: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-round ratios on / off and their medians; the hit rates of every run."""
    out: dict[str, Any] = {}
    for name, (key, stat) in RATIOS.items():
        per = [_ratio(a, b, key, stat) for a, b in zip(on, off)]
        out[name] = {"per_round": per, "median": median(per)}
    for side, runs in (("on", on), ("off", off)):
        rates = [r["prefix_cache"]["hit_rate"] for r in runs]
        out[f"hit_rate_{side}"] = {"per_round": rates, "median": median(rates)}
    out["runs"] = {"on": on, "off": off}
    return out


def compare_prefix_caching(base: EngineConfig, reqs: RequestSet, sc: SweepConfig, rounds: int) -> dict[str, Any]:
    """Every rate of ``sc``, ``rounds`` times, with the cache on and off (interleaved): ``prefix_caching``."""
    model = None
    if not base.synthetic_cost:  # synthetic stages model time: no weights
        model = load_model(base.model, dtype=torch_dtype(base.dtype), device=base.device)
    cfg = mode_config(base, sc.modes[0])
    runs: dict[float, dict[bool, list[dict[str, Any]]]] = {r: {True: [], False: []} for r in sc.rates}
    for k in range(rounds):
        order = (True, False) if k % 2 == 0 else (False, True)
        for rate in sc.rates:
            for on in order:
                label = f"[{k + 1}/{rounds}] cache {'on' if on else 'off'} @ {rate:.4g} req/s"
                setting = replace(cfg, enable_prefix_caching=on)
                runs[rate][on].append(_one_run(setting, model, reqs, rate, sc, label))
    return {
        "mode": sc.modes[0],
        "rounds": rounds,
        "prefill_chunk_size": base.prefill_chunk_size,
        "kv_block_size": base.kv_block_size,
        "rates": {str(r): _summarize_rate(v[True], v[False]) for r, v in runs.items()},
    }


def compare_table(s: dict[str, Any]) -> str:
    """The comparison's ratios, one line per rate (medians over rounds)."""
    c, w = s["prefix_caching"], s["workload"]
    head = (
        f"prefix caching on / off: {w['prefix_count']} prefixes x {w['suffixes']} suffixes, prefix {w['prefix_len']}"
        f" + suffix {w['suffix_len']} tokens, chunk {c['prefill_chunk_size']}, mode {c['mode']}, "
        f"{c['rounds']} rounds (medians)"
    )
    lines = [head, f"{'rate':>8}  {'TTFT p50':>9}  {'TTFT p99':>9}  {'tput':>7}  {'hit on':>7}  {'hit off':>7}"]
    for rate, r in c["rates"].items():
        vals = [r[n]["median"] for n in (*RATIOS, "hit_rate_on", "hit_rate_off")]
        shown = ["-" if v is None else f"{v:.3f}" for v in vals]
        lines.append(f"{rate:>8}  {shown[0]:>9}  {shown[1]:>9}  {shown[2]:>7}  {shown[3]:>7}  {shown[4]:>7}")
    return "\n".join(lines)
