"""One engine's resolved limits and defaults (the model's defaults applied), and the exit policy per request."""

from __future__ import annotations

from dataclasses import dataclass

from cdb_engine.config import EngineConfig
from cdb_model.config import ModelConfig
from cdb_model.kv import KVPolicy
from cdb_scheduler.config import Mode, SchedulerConfig
from cdb_scheduler.exit_policy import ExitPolicy, ExitRule, FixedDepth, Horizon, LatentDiff, OuroHazard, ReplayDepth


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

    def scheduler_config(self, cfg: EngineConfig, mc: ModelConfig) -> SchedulerConfig:
        """The scheduler core's configuration for this engine."""
        return SchedulerConfig(
            max_depth=self.max_depth,
            mode=cfg.mode,
            max_num_seqs=cfg.max_num_seqs,
            num_kv_blocks=cfg.num_kv_blocks,
            kv_block_size=cfg.kv_block_size,
            prefill_token_budget=cfg.prefill_token_budget,
            prefill_chunk_size=cfg.prefill_chunk_size,
            min_head_batch_size=self.min_head_batch_size,
            max_head_wait_steps=cfg.max_head_wait_steps,
            loop_pipeline_depth=cfg.loop_pipeline_depth,
            copy_on_exit=cfg.kv_policy is KVPolicy.LAST_EXITED,
            head_has_kv=mc.num_coda_layers > 0,
            fuse_refill_embed=cfg.fuse_refill_embed and mc.prelude_is_embedding,
        )


def resolve_limits(cfg: EngineConfig, mc: ModelConfig) -> Limits:
    max_depth = cfg.max_depth or mc.max_depth
    rule = cfg.exit_rule
    if rule is ExitRule.AUTO:
        rule = ExitRule.HAZARD if mc.arch == "ouro" else ExitRule.LATENT_DIFF
    if rule is ExitRule.HAZARD and mc.arch != "ouro":
        raise ValueError("exit_rule 'hazard' needs an Ouro model (Huginn has no exit gate)")
    q = cfg.exit_threshold if cfg.exit_threshold is not None else mc.early_exit_threshold
    budget_kv = cfg.num_kv_blocks * cfg.kv_block_size
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
    )
    build_policy(limits, None)  # validates threshold and depths once
    _check_kv_policy(cfg, limits)
    return limits


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
