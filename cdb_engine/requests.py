"""Request admission helpers: limits, validation, exit policies and streaming detokenization."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.errors import InvalidRequest
from cdb_model.config import ModelConfig
from cdb_model.tokenizer import Tokenizer
from cdb_scheduler.exit_policy import ExitPolicy, FixedDepth, Horizon, LatentDiff, OuroHazard, ReplayDepth

MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Limits:
    """Resolved limits and defaults of one engine (model defaults applied)."""

    max_depth: int
    exit_rule: str  # hazard | latent-diff | fixed | replay
    exit_threshold: float
    min_depth: int
    fixed_depth: int
    horizon: Horizon
    max_input_tokens: int
    max_total_tokens: int
    vocab_size: int
    min_coda_batch_size: int


def resolve_limits(cfg: EngineConfig, mc: ModelConfig) -> Limits:
    max_depth = cfg.max_depth or mc.max_depth
    rule = cfg.exit_rule
    if rule == "auto":
        rule = "hazard" if mc.arch == "ouro" else "latent-diff"
    if rule == "hazard" and mc.arch != "ouro":
        raise ValueError("exit_rule 'hazard' needs an Ouro model (Huginn has no exit gate)")
    q = cfg.exit_threshold if cfg.exit_threshold is not None else mc.early_exit_threshold
    budget_kv = cfg.num_kv_blocks * cfg.kv_block_size
    max_total = min(cfg.max_total_tokens or mc.max_positions, mc.max_positions, budget_kv)
    max_input = min(cfg.max_input_tokens or max_total - 1, max_total - 1)
    limits = Limits(
        max_depth=max_depth,
        exit_rule=rule,
        exit_threshold=q,
        min_depth=cfg.min_depth,
        fixed_depth=cfg.fixed_depth or max_depth,
        horizon=Horizon(cfg.horizon),
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        vocab_size=mc.vocab_size,
        min_coda_batch_size=cfg.min_coda_batch_size or (1 if mc.arch == "ouro" else max(1, cfg.max_num_seqs // 4)),
    )
    build_policy(limits, None)  # validates threshold and depths once
    if cfg.kv_policy == "depth_indexed" and cfg.mode != "full-depth" and not _full_depth(limits):
        raise ValueError("kv_policy depth_indexed needs every token at full depth: use mode full-depth")
    if (
        cfg.kv_policy == "first_then_shared"
        and cfg.mode != "full-depth"
        and limits.exit_rule in ("hazard", "latent-diff", "replay")
        and limits.min_depth < cfg.kv_shared_after
    ):
        # A token leaving before step k-1 would leave private slots that later tokens read unwritten.
        raise ValueError(
            f"kv_policy first_then_shared({cfg.kv_shared_after}) needs min_depth >= {cfg.kv_shared_after}, "
            f"got {limits.min_depth}"
        )
    return limits


def _full_depth(limits: Limits) -> bool:
    return limits.exit_rule == "fixed" and limits.fixed_depth == limits.max_depth


def build_policy(limits: Limits, threshold: float | None) -> ExitPolicy:
    """The exit policy of one request (``threshold`` overrides the engine's)."""
    q = limits.exit_threshold if threshold is None else threshold
    if limits.exit_rule == "hazard":
        return OuroHazard(q, limits.max_depth, limits.min_depth, limits.horizon)
    if limits.exit_rule == "latent-diff":
        return LatentDiff(q, limits.max_depth, limits.min_depth, limits.horizon)
    if limits.exit_rule == "fixed":
        return FixedDepth(limits.fixed_depth, limits.max_depth)
    return ReplayDepth(limits.max_depth)


def validate(
    limits: Limits, tokenizer: Tokenizer, prompt: str | list[int], params: RequestParams, kv_policy: str
) -> list[int]:
    """Token ids of ``prompt``, or ``InvalidRequest`` naming the field and the limit."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise InvalidRequest("prompt", "must not be empty")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest("prompt", f"unknown token ids {bad[:5]} (vocabulary size {limits.vocab_size})")
    if len(ids) > limits.max_input_tokens:
        raise InvalidRequest("prompt", f"{len(ids)} tokens exceed max_input_tokens {limits.max_input_tokens}")
    if params.max_tokens < 1:
        raise InvalidRequest("max_tokens", f"must be >= 1, got {params.max_tokens}")
    if len(ids) + params.max_tokens > limits.max_total_tokens:
        raise InvalidRequest(
            "max_tokens",
            f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceed max_total_tokens {limits.max_total_tokens}",
        )
    s = params.sampling
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidRequest("temperature", f"must be a finite number >= 0, got {s.temperature}")
    if not (0.0 < s.top_p <= 1.0):
        raise InvalidRequest("top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0, got {s.top_k}")
    if not 0 <= s.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {s.logprobs}")
    bad_stop = [t for t in params.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad_stop:
        raise InvalidRequest("stop_token_ids", f"unknown token ids {bad_stop[:5]}")
    if any(not s for s in params.stop_strings):
        raise InvalidRequest("stop_strings", "must not contain an empty string")
    if params.exit_threshold is not None:
        if limits.exit_rule in ("fixed", "replay"):
            raise InvalidRequest("exit_threshold", f"not used by the exit rule {limits.exit_rule!r}")
        if kv_policy == "depth_indexed":
            raise InvalidRequest("exit_threshold", "kv_policy depth_indexed serves full depth only")
        try:
            build_policy(limits, params.exit_threshold)
        except ValueError as exc:
            raise InvalidRequest("exit_threshold", str(exc)) from None
    if limits.exit_rule == "replay" and params.replay_depths is None:
        raise InvalidRequest("replay_depths", "required by the exit rule 'replay'")
    if params.replay_depths is not None and any(not 1 <= d <= limits.max_depth for d in params.replay_depths):
        raise InvalidRequest("replay_depths", f"depths must be in [1, {limits.max_depth}]")
    return ids


@dataclass(slots=True)
class Detokenizer:
    """Streams text deltas; holds back an incomplete UTF-8 sequence and text that may begin a stop string."""

    tokenizer: Tokenizer
    stop_strings: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters already emitted

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (new text, whether a stop string was hit — the text stops before it)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        for stop in self.stop_strings:
            at = text.find(stop, max(0, self.sent - len(stop) + 1))
            if at >= 0:
                delta = text[self.sent : at]
                self.sent = at
                return delta, True
        end = len(text)
        if text.endswith("\ufffd"):
            end = len(text.rstrip("\ufffd"))
        hold = max((len(s) - 1 for s in self.stop_strings), default=0)
        for k in range(min(hold, end - self.sent), 0, -1):  # a suffix that may grow into a stop string
            if any(s.startswith(text[end - k : end]) for s in self.stop_strings):
                end -= k
                break
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta, False

    def flush(self) -> str:
        """Text held back at the end of the stream."""
        text = self.tokenizer.decode(self.ids)
        delta = text[self.sent :]
        self.sent = len(text)
        return delta
