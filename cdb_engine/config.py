"""Engine configuration and per-request parameters (frozen, validated once).

Every choice is a typed enum (``StrEnum``: a value is also its string, so ``mode="cdb"`` and ``Mode.CDB`` are the
same); strings given to ``EngineConfig`` are converted once, here, with an error naming the field and the choices.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from cdb_model.kv import KVPolicy
from cdb_scheduler.config import Mode
from cdb_scheduler.exit_policy import ExitRule, Horizon
from cdb_scheduler.plan import SamplingParams


class DType(enum.StrEnum):
    FLOAT32 = "float32"
    FLOAT64 = "float64"  # CPU exactness tests
    BFLOAT16 = "bfloat16"  # CUDA
    FLOAT16 = "float16"


_CHOICES: dict[str, type[enum.StrEnum]] = {
    "dtype": DType,
    "mode": Mode,
    "kv_policy": KVPolicy,
    "horizon": Horizon,
    "exit_rule": ExitRule,
}


def parse_choice(name: str, kind: type[enum.StrEnum], value: Any) -> Any:
    """``value`` as a member of ``kind``; ValueError naming ``name`` and the choices otherwise."""
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}") from None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes the engine. ``None`` fields take the model's defaults."""

    model: str = "ouro-tiny"  # preset name or local checkpoint folder
    dtype: DType = DType.FLOAT32
    device: str = "cpu"
    mode: Mode = Mode.CDB
    max_num_seqs: int = 32  # resident requests = the width of the loop batch
    num_kv_blocks: int = 2048
    kv_block_size: int = 16
    kv_policy: KVPolicy = KVPolicy.LAST_EXITED
    kv_shared_after: int = 2  # first_then_shared: private slots for the first k-1 steps
    max_depth: int | None = None
    exit_rule: ExitRule = ExitRule.AUTO
    exit_threshold: float | None = None  # None: the model's default
    min_depth: int = 1
    fixed_depth: int | None = None  # exit_rule "fixed" (None: max depth)
    horizon: Horizon = Horizon.ONE_AHEAD
    prefill_token_budget: int = 2048
    prefill_chunk_size: int = 512
    min_head_batch_size: int | None = None  # None: 1 for Ouro, max_num_seqs/4 for Huginn
    max_head_wait_steps: int = 4  # ... but an exited token waits for that batch at most this many loop ops
    loop_pipeline_depth: int = 2
    max_input_tokens: int | None = None  # None: model max positions - 1
    max_total_tokens: int | None = None  # None: model max positions
    max_waiting: int = 256  # bounded waiting queue: beyond it, RESOURCE_EXHAUSTED
    init_seed: int = -1  # Huginn initial state: < 0 zero, else seeded truncated normal per position
    num_threads: int | None = None  # torch intra-op threads for the in-process executor
    fuse_refill_embed: bool = True  # Ouro: the head op embeds a refill's input token (no prelude op per step)
    allow_replay_depths: bool = False  # accept per-request replayed depths (benchmarks; implied by exit_rule replay)

    def __post_init__(self) -> None:
        for name, kind in _CHOICES.items():
            object.__setattr__(self, name, parse_choice(name, kind, getattr(self, name)))
        for name in ("max_num_seqs", "num_kv_blocks", "kv_block_size", "max_waiting", "loop_pipeline_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(frozen=True, slots=True)
class RequestParams:
    """What a caller may set per request."""

    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    exit_threshold: float | None = None  # per-request override of the exit threshold
    ignore_eos: bool = False  # do not stop at the model's own stop ids
    replay_depths: tuple[int, ...] | None = None  # benchmarks: served depth of generated token k at [k-1]
