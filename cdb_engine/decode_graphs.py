"""Decode loop ops replayed from CUDA graphs: one launch per op instead of one per kernel.

A decode loop op of Ouro-1.4B is ~1,800 dispatcher calls; on a GPU their launches alone outlast the op's device
work. ``DecodeGraphs`` runs the op's device part (``StageWorker.loop_compute``) on static buffers padded to a width
bucket, for a context bucket (powers of two, whole blocks), and on CUDA captures each (width, context) pair once,
at its first use, then replays it. Padding is harmless by construction: padded tokens read bank row 0, sit at
position 0 in step 0 and write their KV into the stage's scratch block (a block the scheduler never hands out),
through a scratch line of the device block tables; the new rows come out in a static buffer and only the op's own
rows are copied into the bank after the replay.

Without CUDA (tests on a CPU) the same padded function runs eagerly (``capture=False``): the padding, the buckets
and the static buffers are exercised exactly as on a GPU, only the capture is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def width_buckets(max_width: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to 64, then of 32, up to ``max_width`` (which is always one)."""
    out = [w for w in (1, 2, 4) if w < max_width]
    w = 8
    while w < max_width:
        out.append(w)
        w += 8 if w < 64 else 32
    out.append(max_width)
    return tuple(out)


@dataclass
class _Graph:
    cols: Tensor  # [4, width] long: rows, positions, steps, table lines
    outputs: tuple[Tensor, Tensor, Tensor | None] | None  # rows out [width, W], signals [width], lookahead
    graph: Any  # torch.cuda.CUDAGraph, or None when running eagerly
    tables: Tensor  # the block-table tensor it was captured over


class DecodeGraphs:
    """Padded, bucketed, (on CUDA) captured decode loop ops of one ``StageWorker``."""

    def __init__(
        self,
        compute: Callable[[Sequence[Tensor], int], tuple[Tensor, Tensor, Tensor | None]],
        tables: Callable[[], Tensor],
        scratch_line: int,
        max_width: int,
        block_size: int,
        device: torch.device,
        *,
        capture: bool,
    ) -> None:
        """``compute(cols, length)``: the op's device part without the bank write (``loop_compute``);
        ``tables()``: the current block-table tensor (a new one after growth invalidates the graphs)."""
        self.compute, self.tables, self.scratch_line = compute, tables, scratch_line
        self.widths = width_buckets(max_width)
        self.block_size, self.device, self.capture = block_size, device, capture
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0

    def bucket(self, width: int, length: int) -> tuple[int, int]:
        """The (width, context) bucket of an op; ValueError when it is wider than the largest bucket."""
        if width > self.widths[-1]:
            raise ValueError(f"a decode op of {width} tokens exceeds the widest graph ({self.widths[-1]})")
        wb = next(w for w in self.widths if w >= width)
        cap = self.tables().shape[1] * self.block_size
        lb = self.block_size
        while lb < length:
            lb *= 2
        return wb, max(min(lb, cap), length)

    def _padding(self, width: int) -> Tensor:
        pad = torch.zeros((4, width), dtype=torch.long, device=self.device)
        pad[3] = self.scratch_line  # row 0 (read only), position 0, step 0, the scratch line
        return pad

    def _build(self, width: int, length: int) -> _Graph:
        cols = self._padding(width)
        tables = self.tables()
        if not self.capture:  # the same static, padded buffers, computed at each run
            return _Graph(cols, None, None, tables)
        # Warm up on a side stream (allocations, lazy inits), then capture; all-padding inputs touch only scratch.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.compute(list(cols), length)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self.compute(list(cols), length)
        self.captures += 1
        return _Graph(cols, outputs, graph, tables)

    def run(self, cols: Tensor, width: int, length: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Run the op whose columns are ``cols [4, width]`` (on the device). Returns its bank rows ``[width]`` and
        new rows ``[width, W]``, signals and lookahead (views of static buffers: use them before the next op)."""
        key = self.bucket(width, length)
        g = self._graphs.get(key)
        if g is None or g.tables is not self.tables():
            g = self._graphs[key] = self._build(*key)
        g.cols[:, :width].copy_(cols)
        if width < key[0]:
            g.cols[:, width:].copy_(self._padding(key[0] - width))
        if g.graph is not None and g.outputs is not None:
            g.graph.replay()
            x, signal, look = g.outputs
        else:
            x, signal, look = self.compute(list(g.cols), key[1])
        return cols[0], x[:width], signal[:width], look[:width] if look is not None else None
