"""A stage worker's op crosses between host and device once each way: its columns in (``columns_to_device``), its
result tensors out (``Outputs``; a head's sampled tokens and logprob columns unpacked from them: ``Sampled``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cdb_model.batched_sampling import SamplingColumns, unpack_logprobs
from cdb_scheduler.sampling import SamplingParams, TokenLogprobs


def columns_to_device(
    device: torch.device, *columns: Sequence[int], floats: Tensor | None = None
) -> tuple[list[Tensor], Tensor | None]:
    """An op's integer columns (any lengths) and an optional float64 table, on ``device`` in ONE host -> device
    copy (the table's bits ride in the same buffer). Returns one 1-D long tensor per column, and the table."""
    flat = [v for col in columns for v in col]
    packed = torch.tensor(flat, dtype=torch.long)
    if floats is not None:
        packed = torch.cat((packed, floats.reshape(-1).view(torch.long)))
    dev = packed.to(device, non_blocking=True)
    cols = list(dev[: len(flat)].split([len(c) for c in columns])) if columns else []
    table = dev[len(flat) :].view(torch.float64).view(floats.shape) if floats is not None else None
    return cols, table


class Outputs:
    """The result tensors of one op, brought to the host with one copy."""

    def __init__(self) -> None:
        self.parts: list[Tensor] = []
        self.sizes: list[int] = []

    def add(self, t: Tensor) -> int:
        """Queue ``t`` (any shape, exact in float64); returns its slot."""
        self.parts.append(t.reshape(-1).double())
        self.sizes.append(t.numel())
        return len(self.parts) - 1

    def fetch(self) -> list[list[float]]:
        if not self.parts:
            return []
        flat = torch.cat(self.parts).tolist()  # the one device -> host copy of the op
        out, at = [], 0
        for n in self.sizes:
            out.append(flat[at : at + n])
            at += n
        return out


class Sampled:
    """A head's sampled tokens (and logprob columns) as tensors, unpacked after the op's one copy out."""

    def __init__(self, outputs: Outputs, tokens: Tensor, lp: Tensor | None, cols: SamplingColumns) -> None:
        self.tokens_slot = outputs.add(tokens)
        self.lp_slot = outputs.add(lp) if lp is not None else -1
        self.cols = cols

    def unpack(
        self, fetched: list[list[float]], params: tuple[SamplingParams, ...]
    ) -> tuple[tuple[int, ...], tuple[TokenLogprobs | None, ...]]:
        tokens = tuple(int(t) for t in fetched[self.tokens_slot])
        if self.lp_slot < 0:
            return tokens, (None,) * len(tokens)
        flat, rows = fetched[self.lp_slot], self.cols.logprob_rows
        width = len(flat) // len(rows)
        packed = [flat[i * width : (i + 1) * width] for i in range(len(rows))]
        return tokens, tuple(unpack_logprobs(packed, params, rows, len(tokens)))
