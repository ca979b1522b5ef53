"""The memory plan of a tree: weights + working memory + KV cache against the device's memory, before anything loads.

``plan_memory`` adds up, for the three stage processes on one device:
- **weights**: what each stage process loads (``stage_weights``), in the compute dtype; Ouro's loop stage also holds
  the head and the embedding (the fused loop head), its head stage the embedding (fused refills);
- **working memory**: per process a CUDA context and allocator reserve (``CUDA_CONTEXT``, on CUDA only), the bank
  of hidden states (resident + prefill rows), one prefill budget's activations in float32, the head's float32
  logits over a prefill budget (prompt logprobs) and one prefill chunk's attention scores;
- **KV cache**: K and V per position of every layer with KV in each stage, the loop layers once per depth slot of
  the KV policy (``KVLayout.n_slots``: ``depth_indexed`` and ``last_exited`` keep ``max_depth`` slots, ``single``
  one), times the block size, per block of the pool (every stage's pool has the same blocks).

The budget, first match wins: ``kv_cache_memory`` bytes for the KV cache alone (vLLM's ``--kv-cache-memory``);
else ``gpu_memory_utilization`` of the device's total memory on CUDA (vLLM's meaning: the share of the GPU this
server may use, weights and working memory included), or of the RAM available at start on a CPU. With
``num_kv_blocks`` auto the pool takes what is left, capped at what ``max_num_seqs`` sequences of the longest
allowed length can hold (more would never be used) and, on a CPU without ``kv_cache_memory``, at ``CPU_KV_TOKENS``
(a CPU serves few long sequences, and every block is zeroed at start); given, it is checked against the budget.
An auto pool that cannot hold one sequence of the longest allowed length (``max_total_tokens``, vLLM's
``--max-model-len``; a given pool bounds that length instead) and a plan whose weights and working memory alone
exceed the budget are refused, in one line naming the numbers and the knobs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cdb_engine import hardware
from cdb_engine.config import DType, EngineConfig
from cdb_model.config import ModelConfig
from cdb_model.kv_layout import KVLayout
from cdb_model.loader import load_config
from cdb_scheduler.plan import Stage

GIB = 1 << 30
CUDA_CONTEXT = 640 << 20  # a stage process's CUDA context and the allocator's reserve (bytes)
CPU_KV_TOKENS = 32_768  # a CPU's default KV pool at most (2,048 blocks of 16)
_BYTES = {DType.FLOAT32: 4, DType.FLOAT64: 8, DType.BFLOAT16: 2, DType.FLOAT16: 2}


class MemoryPlanError(ValueError):
    """A plan that cannot fit; the message is one line naming the numbers and the knobs."""


def stage_weights(stage: Stage, config: ModelConfig) -> set[Stage]:
    """The parts of the model a stage process loads. Ouro's loop stage also holds the head (final norm, LM head,
    embedding): a loop op may sample the tokens that left the loop and embed their successors (``LoopHead``,
    ``--fuse-loop-head``)."""
    return {stage, Stage.HEAD} if stage is Stage.LOOP and config.prelude_is_embedding else {stage}


def stored_params(stage: Stage, mc: ModelConfig) -> int:
    """Parameters a stage process holds (``stage_weights``), embedding tables included."""
    prelude, loop, head = mc.stage_param_counts()
    embedding = mc.vocab_size * mc.hidden_size
    counts = {Stage.PRELUDE: prelude + embedding, Stage.LOOP: loop, Stage.HEAD: head}
    if mc.prelude_is_embedding:  # Ouro: the head embeds a refill's input token (an untied head holds both)
        counts[Stage.HEAD] = head + (0 if mc.tie_embeddings else embedding)
    return sum(counts[s] for s in stage_weights(stage, mc))


def fmt(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 100 else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    device: str
    budget: int  # bytes this server may use (weights + working + KV), or the KV cache's own with kv_cache_memory
    budget_source: str
    weights: int
    working: int
    block_bytes: int
    blocks: int
    max_blocks: int  # what max_num_seqs sequences of the longest length hold (auto's cap)
    block_size: int
    kv_only_budget: bool

    @property
    def kv(self) -> int:
        return self.blocks * self.block_bytes

    def describe(self) -> str:
        capped = " (capped)" if self.blocks == self.max_blocks else ""
        return (
            f"memory on {self.device}: {self.budget_source}; weights {fmt(self.weights)} + working "
            f"{fmt(self.working)} + KV cache {fmt(self.kv)} = {fmt(self.weights + self.working + self.kv)}; "
            f"{self.blocks:,} KV blocks of {self.block_size} tokens ({fmt(self.block_bytes)} each) = "
            f"{self.blocks * self.block_size:,} tokens{capped}"
        )


def block_bytes(cfg: EngineConfig, mc: ModelConfig, max_depth: int) -> int:
    """Bytes of one KV block across every stage's pool."""
    slots = KVLayout(cfg.kv_policy, max_depth, cfg.kv_shared_after).n_slots
    return mc.kv_bytes_per_token(slots, _BYTES[cfg.dtype]) * cfg.kv_block_size


def working_bytes(cfg: EngineConfig, mc: ModelConfig, max_len: int) -> int:
    """The working memory of the three stage processes (module docstring)."""
    width = cfg.prefill_token_budget
    bank = (cfg.max_num_seqs + width) * mc.bank_width * _BYTES[cfg.dtype]
    activations = width * (6 * mc.hidden_size + 2 * mc.intermediate_size) * 4
    logits = max(width, cfg.max_num_seqs) * mc.vocab_size * 4
    scores = min(cfg.prefill_chunk_size, max_len) * max_len * mc.num_heads * 4
    contexts = 3 * CUDA_CONTEXT if cfg.device.startswith("cuda") else 0
    return contexts + 3 * bank + 2 * activations + logits + scores


def _budget(cfg: EngineConfig) -> tuple[int, str, bool]:
    if cfg.kv_cache_memory is not None:
        return cfg.kv_cache_memory, f"kv_cache_memory {fmt(cfg.kv_cache_memory)}", True
    share = cfg.gpu_memory_utilization
    if cfg.device.startswith("cuda"):
        sizes = hardware.cuda_memory()
        index = hardware.device_index(cfg.device)
        if index >= len(sizes):  # (the preflight names a missing device before this)
            raise MemoryPlanError(f"--device {cfg.device}: this machine has {len(sizes)} CUDA device(s)")
        total = sizes[index]
        return int(share * total), f"gpu_memory_utilization {share:g} of {fmt(total)}", False
    available = hardware.host_memory()[1]
    return int(share * available), f"gpu_memory_utilization {share:g} of {fmt(available)} RAM available", False


def plan_memory(cfg: EngineConfig, mc: ModelConfig | None = None) -> MemoryPlan:
    """The plan of ``cfg`` (module docstring); ``MemoryPlanError`` when it cannot fit."""
    mc = mc or load_config(cfg.model)
    max_depth = cfg.max_depth or mc.max_depth
    max_len = min(cfg.max_total_tokens or mc.max_positions, mc.max_positions)
    per_block = block_bytes(cfg, mc, max_depth)
    seq_blocks = math.ceil(max_len / cfg.kv_block_size)
    max_blocks = cfg.max_num_seqs * seq_blocks
    if not cfg.device.startswith("cuda") and cfg.kv_cache_memory is None:
        max_blocks = min(max_blocks, max(seq_blocks, CPU_KV_TOKENS // cfg.kv_block_size))
    synthetic = bool(cfg.synthetic_cost)  # synthetic stages load no weights and hold no KV
    weights = 0 if synthetic else sum(stored_params(s, mc) for s in Stage) * _BYTES[cfg.dtype]
    working = 0 if synthetic else working_bytes(cfg, mc, max_len)
    budget, source, kv_only = _budget(cfg)
    left = budget if kv_only else budget - weights - working
    if synthetic:
        blocks = cfg.num_kv_blocks or max_blocks
    else:
        fits = max(0, left) // per_block
        blocks = cfg.num_kv_blocks or min(fits, max_blocks)
        after = f"after weights {fmt(weights)} and working memory {fmt(working)}"
        room = (
            f"{source} for the KV cache" if kv_only else f"{source} leaves {fmt(max(0, left))} for the KV cache {after}"
        )
        _check(cfg, room, left, per_block, blocks, fits, seq_blocks, max_len)
    return MemoryPlan(
        cfg.device, budget, source, weights, working, per_block, blocks, max_blocks, cfg.kv_block_size, kv_only
    )


def _check(
    cfg: EngineConfig,
    room: str,
    left: int,
    per_block: int,
    blocks: int,
    fits: int,
    seq_blocks: int,
    max_len: int,
) -> None:
    knobs = "raise --gpu-memory-utilization (or set --kv-cache-memory), lower --max-model-len or --max-num-seqs"
    if left <= 0:
        raise MemoryPlanError(f"memory: {room}: {knobs}, or use a smaller dtype")
    if blocks > fits:
        raise MemoryPlanError(
            f"memory: --num-kv-blocks {blocks:,} needs {fmt(blocks * per_block)} of KV cache; {room} "
            f"({fits:,} blocks): lower --num-kv-blocks or leave it auto"
        )
    if cfg.num_kv_blocks is None and blocks < seq_blocks:  # (a given pool bounds max_total_tokens instead)
        raise MemoryPlanError(
            f"memory: {room}: {blocks:,} blocks of {cfg.kv_block_size} tokens ({fmt(per_block)} each, kv_policy "
            f"{cfg.kv_policy}), fewer than one sequence of {max_len:,} tokens needs ({seq_blocks:,}): {knobs}, or "
            f"use --kv-policy single"
        )


def sized(cfg: EngineConfig, mc: ModelConfig | None = None) -> EngineConfig:
    """``cfg`` with its KV pool sized (``num_kv_blocks`` auto: the plan's blocks); unchanged when given."""
    if cfg.num_kv_blocks is not None:
        return cfg
    return dataclasses.replace(cfg, num_kv_blocks=plan_memory(cfg, mc).blocks)
