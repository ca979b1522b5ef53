"""Engine configuration and per-request parameters (frozen, validated once)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cdb_scheduler.plan import SamplingParams

MODES = ("cdb", "no-refill", "full-depth")
KV_POLICIES = ("depth_indexed", "last_exited", "single", "first_then_shared")
HORIZONS = ("one-ahead", "same-step")
EXIT_RULES = ("auto", "hazard", "latent-diff", "fixed", "replay")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes the engine. ``None`` fields take the model's defaults."""

    model: str = "ouro-tiny"  # preset name or local checkpoint folder
    dtype: str = "float32"  # float32 | float64 (CPU exactness tests) | bfloat16 (CUDA)
    device: str = "cpu"
    mode: str = "cdb"
    max_num_seqs: int = 32
    num_kv_blocks: int = 2048
    kv_block_size: int = 16
    kv_policy: str = "last_exited"
    kv_shared_after: int = 2  # first_then_shared: private slots for the first k-1 steps
    max_depth: int | None = None
    exit_rule: str = "auto"  # auto: Ouro gate hazard, Huginn latent difference
    exit_threshold: float | None = None  # None: the model's default
    min_depth: int = 1
    fixed_depth: int | None = None  # exit_rule "fixed" (None: max depth)
    horizon: str = "one-ahead"
    prefill_token_budget: int = 2048
    prefill_chunk_size: int = 512
    min_coda_batch_size: int | None = None  # None: 1 for Ouro, width/4 for Huginn
    loop_pipeline_depth: int = 2
    max_input_tokens: int | None = None  # None: model max positions - 1
    max_total_tokens: int | None = None  # None: model max positions
    max_waiting: int = 256  # bounded waiting queue: beyond it, RESOURCE_EXHAUSTED
    init_seed: int = -1  # Huginn initial state: < 0 zero, else seeded truncated normal per position
    num_threads: int | None = None  # torch intra-op threads for the in-process executor

    def __post_init__(self) -> None:
        choices = [("mode", MODES), ("kv_policy", KV_POLICIES), ("horizon", HORIZONS), ("exit_rule", EXIT_RULES)]
        for name, allowed in choices:
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if self.dtype not in ("float32", "float64", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, float64, bfloat16 or float16; got {self.dtype!r}")
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
