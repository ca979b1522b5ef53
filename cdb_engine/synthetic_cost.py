"""Modelled device time of a synthetic stage's ops (``cdb_engine.synthetic``).

Cost of one op (µs), per stage, from a SPEC:
- explicit, ``loop=A:B:C,head=A:B:C,prelude=A:B:C`` (a stage left out costs nothing): ``A + B * tokens +
  C * context / 1000``, where ``tokens`` are the op's tokens (the head: the sampled ones) and ``context`` the
  KV positions they read in a stage with KV layers: ``position + 1`` per decode token, and per request once for a
  prefill chunk (its last position + 1: a chunk's queries read their context together, as flash attention does);
- a named profile ``DEVICE:MODEL`` (``h200:ouro-1.4b``, ``h200:huginn-3.5b``), from the released checkpoint's
  shape in bf16 and the device's memory bandwidth ``BW`` and dense bf16 peak ``F`` (roofline):
  ``max(W / BW, 2 * P * tokens / F) + KV * context / BW`` with ``P`` the stage's parameters per op
  (``ModelConfig.stage_param_counts``), ``W = 2 P`` bytes and ``KV`` the K and V bytes of one position in the
  stage's layers (one depth slot). A prefill loop op runs ``num_steps`` such steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cdb_model.config import ModelConfig
from cdb_model.released import HUGINN_0125, OURO_14B
from cdb_scheduler.plan import Stage


@dataclass(frozen=True, slots=True)
class Device:
    """What bounds a stage op on a device: memory bandwidth (bytes/s) and dense bf16 peak (FLOP/s)."""

    bandwidth: float
    flops: float


DEVICES = {"h200": Device(bandwidth=4.8e12, flops=989e12)}
MODELS: dict[str, dict[str, Any]] = {"ouro-1.4b": OURO_14B, "huginn-3.5b": HUGINN_0125}
_DTYPE_BYTES = 2  # bf16


@dataclass(frozen=True, slots=True)
class OpCost:
    """Modelled device time of one op (µs): ``A + B * tokens`` (``roofline``: ``max(A, B * tokens)``) plus
    ``C * context / 1000``."""

    fixed_us: float = 0.0
    per_token_us: float = 0.0
    per_kctx_us: float = 0.0
    roofline: bool = False

    def seconds(self, tokens: int, context: int) -> float:
        work = self.per_token_us * tokens
        body = max(self.fixed_us, work) if self.roofline else self.fixed_us + work
        return 1e-6 * (body + self.per_kctx_us * context / 1000.0)

    def describe(self) -> str:
        op = "max" if self.roofline else "+"
        return f"{self.fixed_us:g}{op}{self.per_token_us:g}/tok+{self.per_kctx_us:g}/kctx µs"


@dataclass(frozen=True, slots=True)
class SyntheticCost:
    """Modelled op costs of the three stages (``parse_cost``)."""

    spec: str
    prelude: OpCost
    loop: OpCost
    head: OpCost

    def of(self, stage: Stage) -> OpCost:
        return (self.prelude, self.loop, self.head)[stage]

    def describe(self) -> str:
        return f"{self.spec} (" + ", ".join(f"{s.role} {self.of(s).describe()}" for s in Stage) + ")"


def profile_cost(device: str, model: str) -> SyntheticCost:
    """The named profile ``DEVICE:MODEL`` (see the module docstring for the formula)."""
    if device not in DEVICES:
        raise ValueError(f"synthetic cost: unknown device {device!r} (one of {', '.join(DEVICES)})")
    if model not in MODELS:
        raise ValueError(f"synthetic cost: unknown model {model!r} (one of {', '.join(MODELS)})")
    dev, c = DEVICES[device], ModelConfig.from_hf(MODELS[model], name=model)
    params = c.stage_param_counts()
    kv_layers = (c.num_prelude_layers, c.num_loop_layers, c.num_coda_layers)
    costs = []
    for stage in Stage:
        p, layers = params[stage], kv_layers[stage]
        weights_s = _DTYPE_BYTES * p / dev.bandwidth
        flops_s = 2 * p / dev.flops
        kv_bytes = 2 * c.kv_size * _DTYPE_BYTES * layers  # K and V of one position, one depth slot
        if stage is Stage.PRELUDE and p == 0:  # an embedding lookup: one row read per token
            weights_s, flops_s = 0.0, _DTYPE_BYTES * c.hidden_size / dev.bandwidth
        costs.append(OpCost(1e6 * weights_s, 1e6 * flops_s, 1e9 * kv_bytes / dev.bandwidth, roofline=True))
    return SyntheticCost(f"{device}:{model}", *costs)


def parse_cost(spec: str) -> SyntheticCost:
    """A SPEC (module docstring) as costs; ValueError naming what is wrong."""
    text = spec.strip()
    if not text:
        raise ValueError("synthetic cost: empty SPEC")
    if "=" not in text:
        device, sep, model = text.partition(":")
        if not sep:
            raise ValueError(f"synthetic cost {spec!r}: expected DEVICE:MODEL or stage=A:B:C,...")
        return profile_cost(device.strip().lower(), model.strip().lower())
    costs = {stage: OpCost() for stage in Stage}
    for part in text.split(","):
        role, _, values = part.partition("=")
        try:
            stage = Stage.from_role(role.strip())
        except ValueError as exc:
            raise ValueError(f"synthetic cost {spec!r}: {exc}") from None
        fields = values.split(":")
        try:
            numbers = [float(v) for v in fields]
        except ValueError:
            numbers = []
        if len(numbers) != 3 or any(not math.isfinite(v) or v < 0 for v in numbers):
            raise ValueError(f"synthetic cost {spec!r}: {stage.role} needs A:B:C, three numbers >= 0 (µs)")
        costs[stage] = OpCost(numbers[0], numbers[1], numbers[2])
    return SyntheticCost(text, costs[Stage.PRELUDE], costs[Stage.LOOP], costs[Stage.HEAD])
