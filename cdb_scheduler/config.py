"""Scheduler configuration: one frozen, validated dataclass."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Mode(enum.StrEnum):
    """Scheduling modes; they share all code but the policy."""

    CDB = "cdb"  # continuous depth batching: freed loop slots are refilled at once, at any depth
    NO_REFILL = "no-refill"  # early exit in lockstep waves: freed slots stay empty until the wave drains
    FULL_DEPTH = "full-depth"  # continuous batching with every token at max depth


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and policies of the scheduler. ``max_depth`` and ``kv_slots_policy`` come from the engine."""

    max_depth: int
    mode: Mode = Mode.CDB
    max_num_seqs: int = 32  # resident requests = width of the loop batch
    num_kv_blocks: int = 1024
    kv_block_size: int = 16
    kv_margin: float = 0.2  # admit a prefill only if free KV blocks stay above this fraction (or nothing decodes)
    prefill_token_budget: int = 2048  # tokens per prefill op
    prefill_chunk_size: int = 512  # prompts are chunked at multiples of this (result-defining: see docs)
    min_head_batch_size: int = 1
    max_head_in_flight: int = 2
    max_head_wait_steps: int = 1 << 30  # an exited token waits for a head batch at most this many loop ops
    loop_pipeline_depth: int = 2  # loop ops in flight: the stage starts k+1 the moment k ends
    copy_on_exit: bool = False  # KV policy last_exited: on exit after step e, slot e is copied deeper
    head_has_kv: bool = False  # Huginn: the head runs coda blocks over every prompt position (their KV)
    fuse_refill_embed: bool = False  # the head op embeds a successor's input token (Ouro: no prelude op)
    fuse_loop_head: bool = False  # the loop op samples the tokens that left the loop (Ouro: no head op per step)
    # Self-speculative decoding (``cdb_scheduler.speculation``): a token's successor starts from a draft read at a
    # shallow depth while the token still loops, and is kept only if the token's real sample equals the draft.
    spec_supported: bool = False  # the model, KV policy and mode allow it (fused loop head; KV exact per step)
    speculate: bool = False  # requests speculate unless they say otherwise (needs spec_supported)
    spec_adaptive: bool = True  # draft depth and pauses follow each request's measured acceptance (auto)
    spec_max_tokens: int = 4  # tokens of one request running ahead of its oldest unverified one, at most
    spec_depth: int = 1  # the draft depth a request starts at (loop steps before its token is drafted)
    spec_max_width: int = 1 << 30  # drafts only while a loop op holds fewer tokens than this (drafts included)
    priority_depth: bool = False  # requests below the most urgent priority run shallower while others wait
    prefix_caching: bool = False  # full prompt blocks are cached and reused (``cdb_scheduler.prefix_cache``)

    def __post_init__(self) -> None:
        checks = [
            (self.max_depth >= 1, "max_depth must be >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1"),
            (self.kv_block_size >= 1, "kv_block_size must be >= 1"),
            (0.0 <= self.kv_margin < 1.0, "kv_margin must be in [0, 1)"),
            (self.prefill_chunk_size >= 1, "prefill_chunk_size must be >= 1"),
            (
                self.prefill_token_budget >= self.prefill_chunk_size,
                "prefill_token_budget must be >= chunk size",
            ),
            (self.min_head_batch_size >= 1, "min_head_batch_size must be >= 1"),
            (self.max_head_in_flight >= 1, "max_head_in_flight must be >= 1"),
            (self.max_head_wait_steps >= 1, "max_head_wait_steps must be >= 1"),
            (self.loop_pipeline_depth >= 1, "loop_pipeline_depth must be >= 1"),
            (self.spec_max_tokens >= 1, "spec_max_tokens must be >= 1"),
            (self.spec_max_width >= 1, "spec_max_width must be >= 1"),
            (1 <= self.spec_depth < self.max_depth or self.max_depth == 1, "spec_depth must be in [1, max_depth)"),
            (self.spec_supported or not self.speculate, "speculate needs spec_supported"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def admit_min_free_rows(self) -> int:
        """Prefill is admitted only when at least this many resident slots are free (batches admissions)."""
        return max(1, self.max_num_seqs // 8)
