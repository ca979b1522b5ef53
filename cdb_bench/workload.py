"""Seeded offline workloads: random prompts, output lengths and (optionally) replayed per-token depths."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cdb_engine.config import EngineConfig, RequestParams, Speculative
from cdb_engine.engine import Engine
from cdb_scheduler.exit_policy import ExitRule
from cdb_scheduler.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class Workload:
    """A seeded offline workload: prompts (random token ids), output lengths, replayed depths."""

    prompts: list[list[int]]
    params: list[RequestParams]

    @property
    def output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)


def depth_sampler(rng: random.Random, mean: float, lo: int, hi: int) -> Callable[[], int]:
    """Depths in [lo, hi] with the given mean: lo + Binomial(hi - lo, p)."""
    if not lo <= mean <= hi:
        raise ValueError(f"mean depth {mean} outside [{lo}, {hi}]")
    n = hi - lo
    p = (mean - lo) / n if n else 0.0
    return lambda: lo + sum(rng.random() < p for _ in range(n))


def make_workload(
    *,
    vocab: int,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    depth: tuple[float, int, int] | None,
    seed: int = 0,
) -> Workload:
    """``depth = (mean, min, max)`` replays per-token depths; None lets the live exit rule decide."""
    rng = random.Random(seed)
    draw = depth_sampler(rng, *depth) if depth else None
    prompts, params = [], []
    for _ in range(num_requests):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))])
        n = rng.randint(*output_len)
        replay = tuple(draw() for _ in range(n - 1)) if draw else None
        params.append(RequestParams(max_tokens=n, sampling=SamplingParams(), ignore_eos=True, replay_depths=replay))
    return Workload(prompts, params)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The options every benchmark shares: the model, the engine's shape and the seeded workload."""
    p.add_argument("--model", default="ouro-bench", help="preset name or checkpoint folder")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=32, help="resident requests: the width of the loop batch")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    p.add_argument("--depth-mean", type=float, default=None, help="replay depths with this mean (default: live)")
    p.add_argument("--depth-min", type=int, default=1)
    p.add_argument("--depth-max", type=int, default=None, help="default: the model's max depth")
    p.add_argument("--kv-policy", default="single")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="torch device of the stages (cuda: the bank is shared by CUDA IPC)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the in-process executor")


def config_and_workload(args: argparse.Namespace, **engine: Any) -> tuple[EngineConfig, Workload]:
    """The engine configuration and the workload ``add_workload_args`` options describe (``engine``: more
    ``EngineConfig`` fields)."""
    replay = args.depth_mean is not None
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        kv_policy=args.kv_policy,
        exit_rule=ExitRule.REPLAY if replay else ExitRule.AUTO,
        num_threads=args.threads,
        # (the KV pool, sized to memory, then holds every resident request at the workload's longest)
        max_total_tokens=args.prompt_len[1] + args.output_len[1],
        **({"speculative": Speculative.OFF} | engine),  # the method's own figures (cdb bench serve --speculative)
    )
    probe = Engine(cfg)
    depth = (args.depth_mean, args.depth_min, args.depth_max or probe.limits.max_depth) if replay else None
    work = make_workload(
        vocab=probe.model_config.vocab_size,
        num_requests=args.requests,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        depth=depth,
        seed=args.seed,
    )
    return cfg, work
