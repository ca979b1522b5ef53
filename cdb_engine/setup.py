"""What every stage needs to know to execute ops (sent to stage servers at configuration time)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(_DTYPES)})") from None


@dataclass(frozen=True, slots=True)
class StageSetup:
    model: str  # preset name or checkpoint folder
    dtype: str
    device: str
    bank_rows: int  # resident rows + prefill rows
    bank_width: int
    kv_policy: str
    kv_shared_after: int
    max_depth: int
    num_kv_blocks: int
    kv_block_size: int
