"""Loop-KV depth policies, per-stage block-table mirrors and the paged KV pool.

A position ``p`` of a request lives in block ``table[p // block_size]`` at offset ``p % block_size``; every stage
uses the same block ids (each stage owns the pool of its own layers). The loop pool has ``n_slots`` depth slots
per layer, chosen by the KV policy (see docs/design.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from cdb_model.kv_layout import KVLayout, KVPolicy
from cdb_scheduler.plan import KVUpdate

__all__ = ["BlockTables", "DeviceBlockTables", "KVLayout", "KVPolicy", "PagedKVPool"]


class BlockTables:
    """A stage's mirror of every resident request's block table, kept current by ``KVUpdate`` deltas."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    def apply(self, updates: Iterable[KVUpdate]) -> None:
        for u in updates:
            table = self._tables.setdefault(u.rid, [])
            if u.reset:
                table.clear()
            table.extend(u.append)

    def release(self, rids: Iterable[int]) -> None:
        for rid in rids:
            self._tables.pop(rid, None)

    def table(self, rid: int) -> list[int]:
        try:
            return self._tables[rid]
        except KeyError:
            raise KeyError(f"no block table for request {rid}") from None

    def lengths(self, rids: Iterable[int]) -> list[int]:
        """The number of blocks of each request (in C-level maps: one op's rows at once)."""
        try:
            return list(map(len, map(self._tables.__getitem__, rids)))
        except KeyError as exc:
            raise KeyError(f"no block table for request {exc.args[0]}") from None

    def __contains__(self, rid: int) -> bool:
        return rid in self._tables

    def __len__(self) -> int:
        return len(self._tables)


class DeviceBlockTables(BlockTables):
    """The block-table mirror, also resident on the device: ``tensor [capacity, columns]`` (long), one line per
    request (``line_of``), updated by each op's deltas in one scatter. A decode op then finds every context
    position's block on the device, with no per-token work on the host. Unused entries hold block 0 (masked out
    by the reader). Lines and columns grow by doubling (a new tensor: captured graphs are rebuilt)."""

    def __init__(self, device: torch.device | str, capacity: int = 64, columns: int = 16) -> None:
        super().__init__()
        self.tensor = torch.zeros((capacity, columns), dtype=torch.long, device=device)
        self.line_of: dict[int, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def apply(self, updates: Iterable[KVUpdate]) -> None:
        lines: list[int] = []
        cols: list[int] = []
        blocks: list[int] = []
        for u in updates:
            table = self._tables.setdefault(u.rid, [])
            if u.reset:
                table.clear()
            start = len(table)
            table.extend(u.append)
            line = self.line_of.get(u.rid)
            if line is None:
                line = self.line_of[u.rid] = self._take_line()
            lines.extend([line] * len(u.append))
            cols.extend(range(start, len(table)))
            blocks.extend(u.append)
        if not blocks:
            return
        if max(cols) >= self.tensor.shape[1]:
            self._grow(columns=max(2 * self.tensor.shape[1], max(cols) + 1))
        index = torch.tensor([lines, cols, blocks], dtype=torch.long).to(self.tensor.device, non_blocking=True)
        self.tensor.index_put_((index[0], index[1]), index[2])

    def release(self, rids: Iterable[int]) -> None:
        for rid in rids:
            self._tables.pop(rid, None)
            line = self.line_of.pop(rid, None)
            if line is not None:
                self._free.append(line)

    def reserve_scratch(self, block: int) -> int:
        """A line no request gets, all of whose entries are ``block`` (where padded tokens write their KV)."""
        line = self._take_line()
        self.tensor[line] = block
        return line

    def lines(self, rids: Sequence[int]) -> list[int]:
        """The device lines of ``rids`` (KeyError naming the first request without a table)."""
        try:
            line_of = self.line_of
            return [line_of[r] for r in rids]
        except KeyError as e:
            raise KeyError(f"no block table for request {e.args[0]}") from None

    def _take_line(self) -> int:
        if not self._free:
            capacity = self.tensor.shape[0]
            self._grow(capacity=2 * capacity)
            self._free = list(range(2 * capacity - 1, capacity - 1, -1))
        return self._free.pop()

    def _grow(self, *, capacity: int | None = None, columns: int | None = None) -> None:
        old = self.tensor
        grown = old.new_zeros((capacity or old.shape[0], columns or old.shape[1]))
        grown[: old.shape[0], : old.shape[1]] = old
        self.tensor = grown


class PagedKVPool:
    """K and V storage ``[layers, n_slots, num_blocks, block_size, kv_heads, head_dim]`` of one stage."""

    def __init__(
        self,
        num_layers: int,
        n_slots: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, n_slots, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers, self.n_slots = num_layers, n_slots
        self.num_blocks, self.block_size = num_blocks, block_size
        # Each layer's K and V as rows ``[slots * blocks * block_size, kv_heads, head_dim]`` (views, made once):
        # attention gathers and writes whole rows with one index op.
        self.k_rows = [self.k[i].view(-1, num_kv_heads, head_dim) for i in range(num_layers)]
        self.v_rows = [self.v[i].view(-1, num_kv_heads, head_dim) for i in range(num_layers)]

    @property
    def device(self) -> torch.device:
        return self.k.device

    def locate(self, table: Sequence[int], positions: Sequence[int]) -> tuple[list[int], list[int]]:
        """(block ids, offsets) of ``positions`` in a request's block ``table``."""
        bs = self.block_size
        try:
            blocks = [table[p // bs] for p in positions]
        except IndexError:
            raise IndexError(
                f"position {max(positions)} beyond the block table ({len(table)} blocks of {bs})"
            ) from None
        return blocks, [p % bs for p in positions]

    def copy_on_exit(self, table: Sequence[int], position: int, from_slot: int) -> None:
        """Copy the KV of ``position`` in slot ``from_slot`` into slots ``from_slot+1 .. n_slots-1`` (all layers)."""
        if not 0 <= from_slot < self.n_slots:
            raise ValueError(f"from_slot {from_slot} outside [0, {self.n_slots})")
        if from_slot == self.n_slots - 1:
            return
        (block,), (off,) = self.locate(table, [position])
        for t in (self.k, self.v):
            src = t[:, from_slot : from_slot + 1, block, off]  # [layers, 1, kvh, hd]
            t[:, from_slot + 1 :, block, off] = src
