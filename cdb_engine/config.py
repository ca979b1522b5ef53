"""Engine configuration and per-request parameters (frozen, validated once).

Every choice is a typed enum (``StrEnum``: a value is also its string, so ``mode="cdb"`` and ``Mode.CDB`` are the
same); strings given to ``EngineConfig`` are converted once, here, with an error naming the field and the choices.
``cdb_engine.preflight.check_config`` is the cheap pre-flight of a whole configuration that a launcher runs
before it starts any process.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, cast

from cdb_model.kv_layout import KVPolicy
from cdb_scheduler.config import Mode
from cdb_scheduler.exit_policy import ExitRule, Horizon
from cdb_scheduler.sampling import LogitsProcessing, SamplingParams


class DType(enum.StrEnum):
    FLOAT32 = "float32"
    FLOAT64 = "float64"  # CPU exactness tests
    BFLOAT16 = "bfloat16"  # CUDA
    FLOAT16 = "float16"


class Speculative(enum.StrEnum):
    """Self-speculative decoding (``cdb_scheduler.speculation``)."""

    AUTO = "auto"  # where the model and KV policy allow it, while rows are free; draft depth adapted per request
    ON = "on"  # always where allowed (an error where not), at the fixed draft depth, never paused
    OFF = "off"


# ``EngineConfig.dtype``'s default: bfloat16 on a CUDA device, float32 elsewhere (resolved at construction, so a
# config's dtype is always a ``DType`` afterwards).
AUTO_DTYPE = cast(DType, "auto")

_CHOICES: dict[str, type[enum.StrEnum]] = {
    "dtype": DType,
    "mode": Mode,
    "kv_policy": KVPolicy,
    "horizon": Horizon,
    "exit_rule": ExitRule,
    "speculative": Speculative,
}


def parse_choice(name: str, kind: type[enum.StrEnum], value: Any) -> Any:
    """``value`` as a member of ``kind``; ValueError naming ``name`` and the choices otherwise."""
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}") from None


def _help(text: str, *aliases: str) -> dict[str, Any]:
    """A field's help: the one text of its ``--option``, its ``CDB_*`` variable and its config-file key; ``aliases``:
    more spellings of its option (vLLM's names)."""
    return {"help": text, "aliases": aliases}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes the engine. ``None`` fields take the model's defaults (``auto`` as an option).

    Each field's ``metadata["help"]`` is its documentation: ``cdb_engine.options`` turns it into the option's
    help, ``services.settings`` into the row of its ``CDB_*`` variable.
    """

    model: str = field(default="ouro-tiny", metadata=_help("a preset name (cdb presets) or a local checkpoint folder"))
    tokenizer: str = field(
        default="", metadata=_help("a tokenizer folder (or tokenizer.json) instead of the model's; empty: the model's")
    )
    dtype: DType = field(default=AUTO_DTYPE, metadata=_help("compute dtype; auto: bfloat16 on CUDA, float32 elsewhere"))
    device: str = field(
        default="auto", metadata=_help("compute device of every process: cpu, cuda or cuda:N; auto: cuda when present")
    )
    mode: Mode = field(
        default=Mode.CDB,
        metadata=_help("cdb: refill freed loop slots at once; no-refill: lockstep waves; full-depth: no early exit"),
    )
    max_num_seqs: int = field(default=32, metadata=_help("resident requests = the width of the loop batch"))
    num_kv_blocks: int | None = field(
        default=None, metadata=_help("KV-cache blocks per pool; auto: sized to memory (cdb_engine.memory)")
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_help("share of the GPU's memory (CPU: of the RAM free at start) the server may use"),
    )
    kv_cache_memory: int | None = field(
        default=None, metadata=_help("bytes of KV cache per device, over gpu_memory_utilization; auto: unset")
    )
    kv_block_size: int = field(default=16, metadata=_help("tokens per KV-cache block"))
    kv_policy: KVPolicy = field(
        default=KVPolicy.LAST_EXITED,
        metadata=_help("which loop-KV depth slot a token writes and reads (depth_indexed: as trained)"),
    )
    kv_shared_after: int = field(
        default=2, metadata=_help("first_then_shared: private KV slots for the first k-1 loop steps, then one shared")
    )
    max_depth: int | None = field(default=None, metadata=_help("loop steps per token at most; auto: the model's"))
    exit_rule: ExitRule = field(
        default=ExitRule.AUTO,
        metadata=_help("what ends a token's loop; auto: the family's own (Ouro hazard, Huginn latent-diff)"),
    )
    exit_threshold: float | None = field(
        default=None,
        metadata=_help("Ouro gate CDF q in (0, 1], Huginn latent diff >= 0; auto: the model's or 0.5 / 0.1"),
    )
    early_exit: bool = field(
        default=True,
        metadata=_help("false (--no-early-exit): the server's default threshold serves every token at full depth"),
    )
    min_depth: int = field(default=1, metadata=_help("loop steps every token runs before it may exit"))
    fixed_depth: int | None = field(
        default=None, metadata=_help("exit rule fixed: every token at this depth; auto: the max depth")
    )
    horizon: Horizon = field(
        default=Horizon.ONE_AHEAD,
        metadata=_help("one-ahead: exit decisions one loop step ahead; same-step: upstream's rule"),
    )
    prefill_token_budget: int = field(default=2048, metadata=_help("prompt tokens prefilled per scheduling step"))
    prefill_chunk_size: int = field(
        default=256,
        metadata=_help("prompt tokens per prefill chunk (a prefix cache hit ends on a multiple of it)"),
    )
    min_head_batch_size: int | None = field(
        default=None, metadata=_help("exited tokens the head waits for; auto: 1 for Ouro, max_num_seqs/4 for Huginn")
    )
    max_head_wait_steps: int = field(
        default=4,
        metadata=_help("an exited token waits at most this many loop ops for a head batch of that size"),
    )
    loop_pipeline_depth: int = field(default=2, metadata=_help("loop ops in flight at once"))
    max_input_tokens: int | None = field(
        default=None, metadata=_help("longest prompt accepted; auto: the model's max positions - 1")
    )
    max_total_tokens: int | None = field(
        default=None,
        metadata=_help("prompt + max_tokens at most; auto: the model's max positions", "--max-model-len"),
    )
    max_waiting: int = field(
        default=256, metadata=_help("bounded waiting queue: beyond it, requests get RESOURCE_EXHAUSTED")
    )
    init_seed: int = field(
        default=-1, metadata=_help("Huginn initial state: < 0 zero, else a seeded truncated normal per position")
    )
    num_threads: int | None = field(
        default=None, metadata=_help("torch intra-op threads of the in-process executor; auto: torch's default")
    )
    fuse_refill_embed: bool = field(
        default=True, metadata=_help("Ouro: the head op embeds a refill's input token (no prelude op per step)")
    )
    fuse_loop_head: bool = field(
        default=True,
        metadata=_help("Ouro: loop ops sample the exited tokens and run their successors (no head op)"),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=_help("reuse the KV of cached prompt prefixes (at chunk boundaries: exact)"),
    )
    priority_depth: float | None = field(
        default=None,
        metadata=_help("while requests wait, less urgent priorities exit at this threshold; auto: off"),
    )
    forced_skip: bool = field(
        default=True,
        metadata=_help("structured output: forced tokens are not sampled, and their positions exit at min depth"),
    )
    speculative: Speculative = field(
        default=Speculative.AUTO,
        metadata=_help("self-speculative decoding: auto (where drafts pay at the measured op cost), on, off"),
    )
    speculative_tokens: int = field(
        default=4, metadata=_help("tokens of one request running ahead of its oldest unverified one, at most")
    )
    speculative_max_occupancy: float | None = field(
        default=None,
        metadata=_help("draft below this share of max_num_seqs; auto: all (on: 0.5 GPU, 0.25 CPU)"),
    )
    speculative_depth: int | None = field(
        default=None,
        metadata=_help("loop steps a token runs before its successor is drafted; auto: 1, adaptive"),
    )
    allow_replay_depths: bool = field(
        default=False,
        metadata=_help("accept per-request replayed depths (benchmarks; implied by exit rule replay)"),
    )
    synthetic_cost: str = field(
        default="",
        metadata=_help("synthetic stages, modelled device time: loop=A:B:C,head=.. (µs) or h200:ouro-1.4b"),
    )
    synthetic_depths: str = field(
        default="",
        metadata=_help("synthetic exit depths MEAN:MIN[:ACCEPT]; empty: 2.5:2 Ouro, 6:3 Huginn"),
    )

    def __post_init__(self) -> None:
        if self.device == "auto":
            from cdb_engine.hardware import default_device

            object.__setattr__(self, "device", default_device())
        if self.dtype == AUTO_DTYPE:
            object.__setattr__(self, "dtype", DType.BFLOAT16 if self.device.startswith("cuda") else DType.FLOAT32)
        for name, kind in _CHOICES.items():
            object.__setattr__(self, name, parse_choice(name, kind, getattr(self, name)))
        if self.synthetic_cost or self.synthetic_depths:
            from cdb_engine.synthetic import SyntheticDepths, parse_cost

            if not self.synthetic_cost:
                raise ValueError("synthetic_depths needs synthetic_cost")
            parse_cost(self.synthetic_cost)
            SyntheticDepths.parse(self.synthetic_depths, "ouro")
        for name in (
            "max_num_seqs",
            "kv_block_size",
            "max_waiting",
            "loop_pipeline_depth",
            "speculative_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("num_kv_blocks", "kv_cache_memory"):
            if (getattr(self, name) or 1) < 1:
                raise ValueError(f"{name} must be >= 1 or auto")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.speculative_max_occupancy is not None and not 0.0 < self.speculative_max_occupancy <= 1.0:
            raise ValueError(f"speculative_max_occupancy must be in (0, 1], got {self.speculative_max_occupancy}")


class StructureKind(enum.StrEnum):
    """What a ``Structure``'s ``spec`` is (vLLM's ``structured_outputs`` keys)."""

    JSON = "json"  # a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (``spec`` empty)
    REGEX = "regex"  # a regular expression the whole output matches
    CHOICE = "choice"  # one of the strings of a JSON array
    GRAMMAR = "grammar"  # a context-free grammar: Lark syntax, or GBNF (llama.cpp's)


@dataclass(frozen=True, slots=True)
class Structure:
    """A request's structured output: the text it generates is a sentence of this (``cdb_engine.grammar`` compiles
    it; the engine refuses what it cannot compile, naming ``field``). Compiled grammars are cached by
    ``(kind, spec)``."""

    kind: StructureKind
    spec: str
    field: str = "structured_outputs"  # the API field it came from (an error names it)


@dataclass(frozen=True, slots=True)
class RequestParams:
    """What a caller may set per request."""

    max_tokens: int = 16  # 0: prefill only (nothing generated; with ``prompt_logprobs``, the prompt scored)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    exit_threshold: float | None = None  # per-request override of the exit threshold
    ignore_eos: bool = False  # do not stop at the model's own stop ids
    replay_depths: tuple[int, ...] | None = None  # benchmarks: served depth of generated token k at [k-1]
    # A broken stream resumed: the tokens it had delivered and their depths (recomputed exactly, not re-sent)
    resume_tokens: tuple[int, ...] = ()
    resume_depths: tuple[int, ...] = ()
    # The logprob of every prompt token after the first (with ``sampling.logprobs`` alternatives), computed from
    # the prefill's full-depth hidden states; reported with the first token (or the finish, if none is generated)
    prompt_logprobs: bool = False
    speculative: bool | None = None  # self-speculative decoding for this request (None: the server's choice)
    skip_special_tokens: bool = True  # the output text leaves special tokens out
    include_stop_str: bool = False  # the output text ends with the stop string it hit (else just before it)
    priority: int = 0  # lower first (vLLM's meaning): the order of the waiting queue, and preempted last
    structure: Structure | None = None  # structured output: the grammar the generated text follows
    cache_salt: str = ""  # prefix caching: only requests of the same salt share cached KV (vLLM's meaning)


def logits_processing(
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
) -> LogitsProcessing | None:
    """A request's ``LogitsProcessing`` from the API's fields, or None when every one is neutral (the sampler's
    fast path). Values are checked by the engine (``validation``)."""
    bias = tuple(sorted((logit_bias or {}).items()))
    if not (presence_penalty or frequency_penalty or repetition_penalty != 1.0 or bias or min_tokens):
        return None
    return LogitsProcessing(
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        logit_bias=bias,
        min_tokens=min_tokens,
    )
