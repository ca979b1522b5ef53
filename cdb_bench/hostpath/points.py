"""The points ``cdb bench hostpath`` measures (family x loop op time x width x consumer x ...), and each point's
engine configuration and request mix."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random

from cdb_engine.config import EngineConfig, RequestParams, Speculative
from cdb_engine.synthetic import parse_cost

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


def request_params(rng: random.Random) -> RequestParams:
    return RequestParams(max_tokens=rng.randint(*OUTPUT_LEN), ignore_eos=True)


def random_prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]


def concurrency(width: int) -> int:
    return width + max(4, width // 4)  # a few waiting requests refill freed slots at once


def engine_config(point: Point) -> EngineConfig:
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
