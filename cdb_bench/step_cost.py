"""What one stage op costs the host: dispatcher calls, kernels, copies, syncs, and the fixed share of its time.

Two measurements:
- ``count_op``: one op run through ``StageWorker.execute`` under a ``TorchDispatchMode`` that sees every
  dispatcher call. Kernels are the calls that are not views; host -> device copies the ``_to_copy`` / ``copy_``
  calls between devices; syncs the scalar reads (``_local_scalar_dense``), device -> host copies and
  ``Tensor.tolist`` calls (the results' one copy back). "Host before the first kernel" is timed apart, without the
  counting mode (which slows every call): the host steps of a decode loop op before its first device kernel —
  the table deltas, the context check and the columns' packing and copy.
- ``fit_fixed_cost``: the wall time of decode loop ops at widths 1 .. 64 (the fastest of several repeats each,
  widths interleaved), fitted by least squares as ``fixed + per_token * width``; ``fixed / per_token`` is the
  fixed cost in tokens' worth, the share of an op no batch amortises.

The released Ouro-1.4B and Huginn-0125 shapes are counted on the meta device (their device part: no memory, no
arithmetic, the same dispatcher calls), the presets on the CPU.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cdb_engine.stage_worker import StageWorker
from cdb_model.config import ModelConfig
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.models import build_empty
from cdb_model.presets import build_preset, preset_config
from cdb_model.released import HUGINN_0125, OURO_14B
from cdb_scheduler.plan import KVUpdate, LoopHead, LoopOp, Stage
from cdb_scheduler.sampling import SamplingParams

RELEASED = {"ouro-1.4b": OURO_14B, "huginn-0125": HUGINN_0125}
_SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}
_COPY_OPS = {"aten._to_copy.default", "aten.copy_.default"}


@dataclass
class OpCounts:
    """Dispatcher-level costs of one op."""

    calls: int = 0
    kernels: int = 0
    host_to_device: int = 0
    syncs: int = 0
    host_tensors: int = 0  # tensors built from host data (the op's columns)
    host_us_before_first_kernel: float = 0.0
    top: list[tuple[str, int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dispatcher_calls": self.calls,
            "kernels": self.kernels,
            "host_to_device_copies": self.host_to_device,
            "syncs_and_copies_out": self.syncs,
            "host_tensors": self.host_tensors,
            "host_us_before_first_kernel": round(self.host_us_before_first_kernel, 1),
            "most_called": dict(self.top),
        }


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.kernels = self.h2d = self.syncs = self.host_tensors = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        self.calls[name] += 1
        if not func.is_view:
            self.kernels += 1
        if name in _SYNC_OPS:
            self.syncs += 1
        elif name == "aten.lift_fresh.default":
            self.host_tensors += 1
        elif name in _COPY_OPS:
            src = args[1] if name == "aten.copy_.default" else args[0]
            dst = args[0].device if name == "aten.copy_.default" else (kwargs or {}).get("device", src.device)
            if src.device != torch.device(dst):
                if src.device.type == "cpu":
                    self.h2d += 1
                else:
                    self.syncs += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting_tolist(counter: _Counter) -> Iterator[None]:
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        counter.syncs += 1
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def count(fn: Callable[[], object]) -> OpCounts:
    """Run ``fn`` once under the counting mode."""
    mode = _Counter()
    with torch.inference_mode(), mode, _counting_tolist(mode):
        fn()
    return OpCounts(
        calls=sum(mode.calls.values()),
        kernels=mode.kernels,
        host_to_device=mode.h2d,
        syncs=mode.syncs,
        host_tensors=mode.host_tensors,
        top=mode.calls.most_common(8),
    )


class DecodeBench:
    """A loop stage worker over ``requests`` requests with ``context`` positions each, issuing decode loop ops."""

    def __init__(
        self,
        model: Any,
        config: ModelConfig,
        requests: int = 64,
        context: int = 64,
        block: int = 16,
        policy: KVPolicy = KVPolicy.DEPTH_INDEXED,
        decode_graphs: bool | None = None,
    ) -> None:
        self.config, self.context = config, context
        device = next(model.parameters()).device
        per = -(-context // block) + 1
        bank = torch.zeros(requests, config.bank_width, dtype=model.dtype, device=device)
        if device.type != "meta":
            bank.normal_(generator=torch.Generator(device=device).manual_seed(0))
        layout = KVLayout(policy, config.max_depth)
        self.worker = StageWorker(model, Stage.LOOP, bank, layout, requests * per, block, decode_graphs=decode_graphs)
        self.worker.tables.apply([KVUpdate(r, tuple(range(r * per, (r + 1) * per))) for r in range(requests)])
        self.seq = 0

    def op(self, width: int, fused_head: bool = False) -> LoopOp:
        self.seq += 1
        pos = self.context - 1
        head = None
        if fused_head:
            head = LoopHead(
                rids=tuple(range(width)),
                positions=(pos,) * width,
                rows=tuple(range(width)),
                sampling=(SamplingParams(),) * width,
                token_index=tuple(range(width)),
                embed_ids=(-1,) * width,
            )
        return LoopOp(
            seq=self.seq,
            fences=(),
            kv_updates=(),
            released=(),
            rids=tuple(range(width)),
            positions=(pos,) * width,
            rows=tuple(range(width)),
            steps=tuple(i % self.config.max_depth for i in range(width)),
            head=head,
        )

    def host_prep_us(self, width: int, repeats: int = 30) -> float:
        """The fastest host preparation of a decode loop op (deltas, context check, columns to the device), µs."""
        w, best = self.worker, float("inf")
        for _ in range(repeats):
            op = self.op(width)
            t0 = time.perf_counter()
            w.tables.release(op.released)
            w.tables.apply(op.kv_updates)
            w._context_length(op.rids, op.positions)
            w._columns(op.rows, op.positions, op.steps, w.tables.lines(op.rids))
            best = min(best, time.perf_counter() - t0)
        return best * 1e6

    def device_part(self, width: int) -> Callable[[], object]:
        """The decode loop op's device part alone (what the meta device can run)."""
        w, op = self.worker, self.op(width)
        length = w._context_length(op.rids, op.positions)
        cols, _ = w._columns(op.rows, op.positions, op.steps, w.tables.lines(op.rids))
        return lambda: w.loop_decode(cols, length)


def preset_costs(name: str, widths: tuple[int, ...] = (32, 64)) -> dict[str, Any]:
    """Counts of a whole decode loop op (and, for Ouro, one with its fused head) of a preset on the CPU."""
    c = preset_config(name)
    fused = c.prelude_is_embedding
    bench = DecodeBench(build_preset(name, stages={Stage.LOOP, Stage.HEAD} if fused else {Stage.LOOP}), c)
    out: dict[str, Any] = {}
    for width in widths:
        bench.worker.execute(bench.op(width))  # warm
        counts = count(functools.partial(bench.worker.execute, bench.op(width)))
        counts.host_us_before_first_kernel = bench.host_prep_us(width)
        out[f"loop_op_{width}"] = counts.as_dict()
        if fused:
            op = bench.op(width, fused_head=True)
            out[f"loop_op_fused_head_{width}"] = count(functools.partial(bench.worker.execute, op)).as_dict()
    return out


def released_costs(name: str, width: int = 64) -> dict[str, Any]:
    """Counts of the device part of a decode loop op of a released shape (bf16, meta device)."""
    config = ModelConfig.from_hf(RELEASED[name], name=name)
    model = build_empty(config, stages={Stage.LOOP}).to(torch.bfloat16)
    bench = DecodeBench(model, config)
    return {f"loop_op_device_part_{width}": count(bench.device_part(width)).as_dict()}


def fit_fixed_cost(
    name: str, widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), repeats: int = 15, context: int = 64
) -> dict[str, Any]:
    """Wall time of decode loop ops per width (fastest of ``repeats``), and its least-squares line."""
    c = preset_config(name)
    bench = DecodeBench(build_preset(name, stages={Stage.LOOP}), c, requests=max(widths), context=context)
    best = {w: float("inf") for w in widths}
    for _ in range(repeats):
        for w in widths:
            op = bench.op(w)
            t0 = time.perf_counter()
            bench.worker.execute(op)
            best[w] = min(best[w], time.perf_counter() - t0)
    xs, ys = list(widths), [best[w] * 1e6 for w in widths]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    return {
        "widths": xs,
        "us_per_op": [round(y, 1) for y in ys],
        "fixed_us": round(fixed, 1),
        "per_token_us": round(slope, 2),
        "fixed_in_tokens": round(fixed / slope, 2) if slope > 0 else None,
        "points": n,
    }
