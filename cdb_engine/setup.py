"""What every stage needs to know to execute ops (sent to stage servers at configuration time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cdb_engine.config import DType, EngineConfig
from cdb_model.config import ModelConfig
from cdb_model.kv_layout import KVPolicy

if TYPE_CHECKING:  # (imported by the stages that compute: the scheduler's process starts without torch)
    import torch


def torch_dtype(name: str) -> torch.dtype:
    import torch

    try:
        return getattr(torch, DType(name).value)
    except ValueError:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(DType)})") from None


@dataclass(frozen=True, slots=True)
class StageSetup:
    model: str  # preset name or checkpoint folder
    dtype: DType
    device: str
    bank_rows: int  # resident rows + prefill rows
    bank_width: int
    kv_policy: KVPolicy
    kv_shared_after: int
    max_depth: int
    num_kv_blocks: int
    kv_block_size: int

    @classmethod
    def of(cls, cfg: EngineConfig, mc: ModelConfig, max_depth: int) -> StageSetup:
        return cls(
            model=cfg.model,
            dtype=cfg.dtype,
            device=cfg.device,
            bank_rows=cfg.max_num_seqs + cfg.prefill_token_budget,
            bank_width=mc.bank_width,
            kv_policy=cfg.kv_policy,
            kv_shared_after=cfg.kv_shared_after,
            max_depth=max_depth,
            num_kv_blocks=sized_blocks(cfg),
            kv_block_size=cfg.kv_block_size,
        )


def sized_blocks(cfg: EngineConfig) -> int:
    """``num_kv_blocks`` of a sized configuration (``cdb_engine.memory.sized``)."""
    if cfg.num_kv_blocks is None:
        raise ValueError("num_kv_blocks is auto: size the configuration first (cdb_engine.memory.sized)")
    return cfg.num_kv_blocks
