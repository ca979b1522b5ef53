"""What every stage needs to know to execute ops (sent to stage servers at configuration time)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cdb_engine.config import DType, EngineConfig
from cdb_model.config import ModelConfig
from cdb_model.kv import KVPolicy

_DTYPES = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT64: torch.float64,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[DType(name)]
    except ValueError:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(_DTYPES)})") from None


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
            num_kv_blocks=cfg.num_kv_blocks,
            kv_block_size=cfg.kv_block_size,
        )
