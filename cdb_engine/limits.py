"""One engine's resolved limits and defaults (the model's defaults applied), and the exit policy per request.

The server's exit threshold, first match wins (``ThresholdSource``):
1. ``--exit-threshold Q`` (``EngineConfig.exit_threshold``);
2. ``--no-early-exit`` (``EngineConfig.early_exit = False``): the rule's full-depth value (Ouro 1.0, Huginn 0.0);
3. the model's own value when it turns exit on: a checkpoint's ``early_exit_threshold`` in ``config.json`` below
   1.0 (``models/ouro-kjv``: its measured knee, 0.5), or a preset's;
4. otherwise the family default (``FAMILY_EXIT_THRESHOLD``), so a released checkpoint serves depth-adaptively.
   The released Ouro ``config.json`` says 1.0 (every token at full depth) and its model card names no lower
   value; the default q = 0.5 is the middle of the CDB paper's Ouro sweep (0.2 / 0.4 / 0.5 / 0.7) and the
   perplexity / greedy-agreement knee measured on ``ouro-kjv`` (docs/benchmarks.md, "Quality against depth").
   Huginn's release has no exit field; its cheap criterion is latent-diff and the default 0.1 is the most
   conservative of the CDB paper's sweep (0.28 / 0.16 / 0.1).
``describe(limits)`` is the one-line summary of what is in effect and why.

Request bounds (``RequestBounds``, ``REQUEST_BOUNDS``): every field a caller sets is checked against them by
``cdb_engine.validation`` before any expensive work (sizes before tokenization, template rendering or parsing), the
same for both front ends. Numeric ranges are what the engine and the wire carry (the stage protocol's ``int32``
``top_k`` and ``logprobs``, the public API's ``uint64`` seed, finite sampling values); sizes and counts are fixed
limits that keep one request's cost on the engine thread small:

| field | bound |
|---|---|
| prompt text (chat: all messages) | at most 1 MiB in UTF-8 (``max_prompt_bytes``), valid Unicode, before tokenization |
| prompt token ids | at most ``max_input_tokens`` ids, each in [0, vocab_size) |
| chat messages | at most 1024 (``max_messages``) |
| ``max_tokens`` | >= 0 (0: prefill only; gRPC and chat: >= 1); prompt + max_tokens <= ``max_total_tokens`` |
| ``temperature`` | 0 (greedy) or in [1e-06, 100] (``min_temperature``, ``max_temperature``) |
| ``top_p`` | in (0, 1] |
| ``min_p`` | in [0, 1] (HTTP) |
| ``top_k`` | in [0, 2^31 - 1] (0: no filter; more than the vocabulary keeps it all) |
| ``seed`` | in [0, 2^64 - 1] |
| ``logprobs`` (top alternatives) | in [0, 20] (``max_logprobs``) |
| stop strings | at most 16 (``max_stop_strings``), each non-empty, valid Unicode, at most 256 UTF-8 bytes |
| stop token ids | at most 256 (``max_stop_token_ids``), each in [0, vocab_size) |
| ``exit_threshold`` | finite, in the exit rule's range (module docstring of ``cdb_engine.validation``) |
| ``replay_depths`` | at most ``max_total_tokens`` values, each in [1, max_depth] |
| ``request_id`` (gRPC) | at most 256 UTF-8 bytes (``max_request_id_bytes``) |
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from cdb_engine.config import EngineConfig, Speculative
from cdb_engine.setup import sized_blocks
from cdb_model.config import ModelConfig
from cdb_model.kv_layout import KVPolicy
from cdb_model.loader import is_preset
from cdb_scheduler.config import Mode, SchedulerConfig
from cdb_scheduler.exit_policy import ExitPolicy, ExitRule, FixedDepth, Horizon, LatentDiff, OuroHazard, ReplayDepth

# Default threshold per threshold rule when the model's own value serves full depth (see the module docstring).
FAMILY_EXIT_THRESHOLD = {ExitRule.HAZARD: 0.5, ExitRule.LATENT_DIFF: 0.1}
# The threshold that serves every token at full depth: Ouro's exit CDF reaches 1 only when the last step takes the
# remaining mass; no relative latent change is below 0.
FULL_DEPTH_THRESHOLD = {ExitRule.HAZARD: 1.0, ExitRule.LATENT_DIFF: 0.0}
_RULE_NAME = {ExitRule.HAZARD: "Ouro exit-gate CDF", ExitRule.LATENT_DIFF: "latent-diff"}


INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class RequestBounds:
    """Size, count and range limits of one request's fields (the module docstring's table)."""

    max_prompt_bytes: int = 1 << 20  # prompt text, or all chat contents together, in UTF-8 bytes
    max_messages: int = 1024  # chat messages per request
    min_temperature: float = 1e-6  # smallest positive temperature (below it the scaled logits overflow to inf)
    max_temperature: float = 100.0
    max_top_k: int = INT32_MAX  # the stage protocol's int32
    max_seed: int = UINT64_MAX  # the public API's uint64
    max_logprobs: int = 20  # top alternatives per token
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_stop_token_ids: int = 256
    max_request_id_bytes: int = 256


REQUEST_BOUNDS = RequestBounds()


class ThresholdSource(enum.StrEnum):
    """Where the server's exit threshold came from (first match wins; module docstring)."""

    OPTION = "option"  # --exit-threshold
    NO_EARLY_EXIT = "no-early-exit"  # --no-early-exit: the full-depth value
    CHECKPOINT = "checkpoint"  # the checkpoint's config.json early_exit_threshold
    PRESET = "preset"  # the built-in preset's threshold
    FAMILY_DEFAULT = "family-default"  # FAMILY_EXIT_THRESHOLD (the model's own value serves full depth)
    UNUSED = "unused"  # the exit rule needs no threshold (fixed, replay)


@dataclass(frozen=True, slots=True)
class Limits:
    """Resolved limits and defaults of one engine (model defaults applied)."""

    max_depth: int
    exit_rule: ExitRule  # never AUTO: resolved to the model family's rule
    exit_threshold: float
    min_depth: int
    fixed_depth: int
    horizon: Horizon
    max_input_tokens: int
    max_total_tokens: int
    vocab_size: int
    min_head_batch_size: int
    replay_allowed: bool  # requests may carry replayed depths
    threshold_source: ThresholdSource = ThresholdSource.UNUSED
    model_threshold: float = 1.0  # the model's own early_exit_threshold (config.json or preset)
    mode: Mode = Mode.CDB
    no_speculation: str = ""  # why this engine cannot speculate ("": it can)

    @property
    def early_exit(self) -> bool:
        """True when tokens may leave the loop before ``max_depth`` by default."""
        if self.mode is Mode.FULL_DEPTH:
            return False
        if self.exit_rule is ExitRule.FIXED:
            return self.fixed_depth < self.max_depth
        if self.exit_rule is ExitRule.REPLAY:
            return True
        return self.exit_threshold != FULL_DEPTH_THRESHOLD[self.exit_rule]

    def scheduler_config(self, cfg: EngineConfig, mc: ModelConfig) -> SchedulerConfig:
        """The scheduler core's configuration for this engine."""
        return SchedulerConfig(
            max_depth=self.max_depth,
            mode=cfg.mode,
            max_num_seqs=cfg.max_num_seqs,
            num_kv_blocks=sized_blocks(cfg),
            kv_block_size=cfg.kv_block_size,
            prefill_token_budget=cfg.prefill_token_budget,
            prefill_chunk_size=cfg.prefill_chunk_size,
            min_head_batch_size=self.min_head_batch_size,
            max_head_wait_steps=cfg.max_head_wait_steps,
            loop_pipeline_depth=cfg.loop_pipeline_depth,
            copy_on_exit=cfg.kv_policy is KVPolicy.LAST_EXITED,
            head_has_kv=mc.num_coda_layers > 0,
            fuse_refill_embed=cfg.fuse_refill_embed and mc.prelude_is_embedding,
            fuse_loop_head=self.fused_loop_head(cfg, mc),
            spec_supported=not self.no_speculation,
            speculate=cfg.speculative is not Speculative.OFF and not self.no_speculation,
            spec_adaptive=cfg.speculative is Speculative.AUTO,
            spec_max_tokens=cfg.speculative_tokens,
            spec_depth=min(cfg.speculative_depth or 1, max(1, self.max_depth - 1)),
            priority_depth=cfg.priority_depth is not None,
            prefix_caching=cfg.enable_prefix_caching,
            # (at least a lone token and one draft, where the width allows)
            spec_max_width=min(cfg.max_num_seqs, max(2, math.floor(spec_occupancy(cfg) * cfg.max_num_seqs))),
        )

    @staticmethod
    def fused_loop_head(cfg: EngineConfig, mc: ModelConfig) -> bool:
        return cfg.fuse_loop_head and mc.prelude_is_embedding and cfg.mode is not Mode.NO_REFILL

    def spec_unsupported(self, cfg: EngineConfig, mc: ModelConfig) -> str | None:
        """Why this engine cannot speculate (None: it can)."""
        if not self.fused_loop_head(cfg, mc):
            return "self-speculative decoding needs the fused loop head (Ouro, fuse_loop_head, mode cdb or full-depth)"
        if cfg.kv_policy not in (KVPolicy.LAST_EXITED, KVPolicy.DEPTH_INDEXED):
            return (
                f"kv_policy {cfg.kv_policy} reads a predecessor's final KV at every step: nothing can start early "
                "(use last_exited)"
            )
        if self.max_depth < 2:
            return "self-speculative decoding needs max_depth >= 2"
        return None


def spec_occupancy(cfg: EngineConfig) -> float:
    """The share of the loop width below which requests draft (``speculative_max_occupancy``). Unset: under
    ``speculative auto`` the whole width (drafts are taken only where they pay at the loop op's fitted cost,
    ``cdb_scheduler.loop_cost``); under ``on``, 0.5 where a loop op's cost is nearly flat in its tokens (a GPU or
    synthetic stages) and 0.25 on a CPU, where each token of an op costs compute."""
    if cfg.speculative_max_occupancy is not None:
        return cfg.speculative_max_occupancy
    if cfg.speculative is Speculative.AUTO:
        return 1.0
    return 0.5 if cfg.device.startswith("cuda") or cfg.synthetic_cost else 0.25


def resolve_limits(cfg: EngineConfig, mc: ModelConfig) -> Limits:
    max_depth = cfg.max_depth or mc.max_depth
    rule = cfg.exit_rule
    if rule is ExitRule.AUTO:
        rule = ExitRule.HAZARD if mc.arch == "ouro" else ExitRule.LATENT_DIFF
    if rule is ExitRule.HAZARD and mc.arch != "ouro":
        raise ValueError("exit_rule 'hazard' needs an Ouro model (Huginn has no exit gate)")
    q, source = _threshold(cfg, mc, rule)
    # (auto: the memory plan holds at least one sequence of the longest length, or refuses to start)
    budget_kv = cfg.num_kv_blocks * cfg.kv_block_size if cfg.num_kv_blocks else mc.max_positions
    max_total = min(cfg.max_total_tokens or mc.max_positions, mc.max_positions, budget_kv)
    max_input = min(cfg.max_input_tokens or max_total - 1, max_total - 1)
    min_head = cfg.min_head_batch_size or (1 if mc.arch == "ouro" else max(1, cfg.max_num_seqs // 4))
    limits = Limits(
        max_depth=max_depth,
        exit_rule=rule,
        exit_threshold=q,
        min_depth=cfg.min_depth,
        fixed_depth=cfg.fixed_depth or max_depth,
        horizon=cfg.horizon,
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        vocab_size=mc.vocab_size,
        min_head_batch_size=min_head,
        replay_allowed=cfg.allow_replay_depths or rule is ExitRule.REPLAY,
        threshold_source=source,
        model_threshold=mc.early_exit_threshold,
        mode=cfg.mode,
    )
    try:
        build_policy(limits, None)  # validates threshold and depths once
    except ValueError as exc:
        raise ValueError(f"{exc} ({source} threshold of {mc.name})") from None
    _check_kv_policy(cfg, limits)
    why = limits.spec_unsupported(cfg, mc)
    if cfg.speculative is Speculative.ON and why is not None:
        raise ValueError(f"speculative on: {why}")
    limits = replace(limits, no_speculation=why or "")
    if cfg.speculative_depth is not None and not 1 <= cfg.speculative_depth < max_depth:
        raise ValueError(f"speculative_depth must be in [1, max_depth {max_depth}), got {cfg.speculative_depth}")
    if cfg.priority_depth is not None:
        _check_priority_depth(cfg, limits)
    return limits


def _check_priority_depth(cfg: EngineConfig, limits: Limits) -> None:
    """``--priority-depth Q``: a threshold of an adaptive rule, in its range, where tokens may exit early."""
    q = cfg.priority_depth
    if cfg.mode is Mode.FULL_DEPTH or limits.exit_rule not in (ExitRule.HAZARD, ExitRule.LATENT_DIFF):
        raise ValueError("priority_depth needs early exit by a threshold (exit rule hazard or latent-diff, mode cdb)")
    if cfg.kv_policy is KVPolicy.DEPTH_INDEXED:
        raise ValueError("priority_depth: kv_policy depth_indexed serves full depth only")
    if q is None or not math.isfinite(q):
        raise ValueError(f"priority_depth must be a finite threshold, got {q}")
    try:
        build_policy(limits, q)
    except ValueError as exc:
        raise ValueError(f"priority_depth: {exc}") from None


def priority_policy(limits: Limits, floor: float | None, threshold: float | None) -> ExitPolicy | None:
    """``--priority-depth``: the policy a request runs while it is below the most urgent priority and requests wait:
    the floor threshold, or the request's own where that one exits sooner (hazard: the lower q; latent-diff: the
    higher); None without the option."""
    if floor is None:
        return None
    own = limits.exit_threshold if threshold is None else threshold
    q = min(own, floor) if limits.exit_rule is ExitRule.HAZARD else max(own, floor)
    return build_policy(limits, q)


def _threshold(cfg: EngineConfig, mc: ModelConfig, rule: ExitRule) -> tuple[float, ThresholdSource]:
    """The server's exit threshold and where it came from (the module docstring's order)."""
    if rule not in FAMILY_EXIT_THRESHOLD:  # fixed, replay: no threshold is used
        return (
            cfg.exit_threshold if cfg.exit_threshold is not None else mc.early_exit_threshold
        ), ThresholdSource.UNUSED
    full = FULL_DEPTH_THRESHOLD[rule]
    if cfg.exit_threshold is not None:
        if not math.isfinite(cfg.exit_threshold):
            raise ValueError(f"--exit-threshold must be a finite number, got {cfg.exit_threshold}")
        if not cfg.early_exit and cfg.exit_threshold != full:
            raise ValueError(
                f"--no-early-exit contradicts --exit-threshold {cfg.exit_threshold} (full depth is {full} for the "
                f"{_RULE_NAME[rule]} rule)"
            )
        return cfg.exit_threshold, ThresholdSource.OPTION
    if not cfg.early_exit:
        return full, ThresholdSource.NO_EARLY_EXIT
    native = ExitRule.HAZARD if mc.arch == "ouro" else ExitRule.LATENT_DIFF
    if rule is native and mc.early_exit_threshold != full:
        return mc.early_exit_threshold, ThresholdSource.PRESET if is_preset(cfg.model) else ThresholdSource.CHECKPOINT
    return FAMILY_EXIT_THRESHOLD[rule], ThresholdSource.FAMILY_DEFAULT


def describe(limits: Limits) -> str:
    """One line: the depth policy in effect and where its threshold came from (for a startup log line)."""
    depths = f"depths {limits.min_depth}-{limits.max_depth}, {limits.horizon} decisions"
    if limits.mode is Mode.FULL_DEPTH:
        return f"early exit off: every token at full depth {limits.max_depth} (mode full-depth)"
    if limits.exit_rule is ExitRule.FIXED:
        state = "off" if limits.fixed_depth == limits.max_depth else "fixed"
        return f"early exit {state}: every token at depth {limits.fixed_depth} of {limits.max_depth} (exit rule fixed)"
    if limits.exit_rule is ExitRule.REPLAY:
        return f"depths replayed per request (exit rule replay), max depth {limits.max_depth}"
    q, rule = limits.exit_threshold, _RULE_NAME[limits.exit_rule]
    why = {
        ThresholdSource.OPTION: "--exit-threshold",
        ThresholdSource.NO_EARLY_EXIT: "--no-early-exit",
        ThresholdSource.CHECKPOINT: "the checkpoint's early_exit_threshold",
        ThresholdSource.PRESET: "the preset's threshold",
        ThresholdSource.FAMILY_DEFAULT: (
            f"family default, as the model's early_exit_threshold {limits.model_threshold:g} serves full depth; "
            "--no-early-exit for that"
            if limits.exit_rule is ExitRule.HAZARD
            else "family default, as the model names no latent-diff threshold; --no-early-exit for full depth"
        ),
        ThresholdSource.UNUSED: "unused",
    }[limits.threshold_source]
    if not limits.early_exit:
        return f"early exit off: every token at full depth {limits.max_depth} ({rule} q = {q:g}, {why})"
    return f"early exit on: {rule} q = {q:g} ({why}), {depths}"


def _check_kv_policy(cfg: EngineConfig, limits: Limits) -> None:
    adaptive = cfg.mode is not Mode.FULL_DEPTH
    full_depth = limits.exit_rule is ExitRule.FIXED and limits.fixed_depth == limits.max_depth
    if cfg.kv_policy is KVPolicy.DEPTH_INDEXED and adaptive and not full_depth:
        raise ValueError("kv_policy depth_indexed needs every token at full depth: use mode full-depth")
    early = limits.exit_rule in (ExitRule.HAZARD, ExitRule.LATENT_DIFF, ExitRule.REPLAY)
    if cfg.kv_policy is KVPolicy.FIRST_THEN_SHARED and adaptive and early and limits.min_depth < cfg.kv_shared_after:
        # A token leaving before step k-1 would leave private slots that later tokens read unwritten.
        raise ValueError(
            f"kv_policy first_then_shared({cfg.kv_shared_after}) needs min_depth >= {cfg.kv_shared_after}, "
            f"got {limits.min_depth}"
        )


def build_policy(limits: Limits, threshold: float | None, replay: bool = False) -> ExitPolicy:
    """The exit policy of one request (``threshold`` overrides the engine's; ``replay``: the request brings its
    own depths)."""
    if replay:
        return ReplayDepth(limits.max_depth)
    q = limits.exit_threshold if threshold is None else threshold
    if limits.exit_rule is ExitRule.HAZARD:
        return OuroHazard(q, limits.max_depth, limits.min_depth, limits.horizon)
    if limits.exit_rule is ExitRule.LATENT_DIFF:
        return LatentDiff(q, limits.max_depth, limits.min_depth, limits.horizon)
    if limits.exit_rule is ExitRule.FIXED:
        return FixedDepth(limits.fixed_depth, limits.max_depth)
    return ReplayDepth(limits.max_depth)
