"""Attention through a KV cache: the ``KVAccess`` interface and its two implementations.

One ``KVAccess`` serves one stage call (a set of tokens with positions, each with its depth slot). For every
layer the model calls ``attend(layer, q, k, v)``: the tokens' K/V are written at their positions into their slot,
then each token attends causally over positions ``0 .. p`` of its OWN request, read from that slot.

- ``DenseKV`` (reference path): one request, plain growing per-(layer, slot) tensors. Deliberately simple.
- ``PagedKV`` (engine): many requests over a ``PagedKVPool`` addressed through block tables.
- ``DecodeKV`` (engine, decode ops): one token per request, everything indexed on the device from the resident
  block tables (``DeviceBlockTables``) — no per-token host work, no host sync, fixed shapes for a context bucket.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from cdb_model.kv import BlockTables, PagedKVPool
from cdb_model.layers import compute_dtype


class KVAccess(Protocol):
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write ``k, v [N, kv_heads, d]`` at the tokens' positions; return ``out [N, heads, d]`` for ``q``.

        Each token attends causally over positions ``0 .. p`` of its own request, scale ``1 / sqrt(d)``.
        """
        ...


class MissingKVError(RuntimeError):
    """A token would attend over a position whose KV was never written in that depth slot."""


class DenseKVCache:
    """KV of ONE request: per (layer, slot) a growing ``[P, kv_heads, d]`` tensor and a written mask ``[P]``."""

    def __init__(self) -> None:
        self.k: dict[tuple[int, int], Tensor] = {}
        self.v: dict[tuple[int, int], Tensor] = {}
        self.written: dict[tuple[int, int], Tensor] = {}

    def _grow(self, key: tuple[int, int], length: int, like: Tensor) -> None:
        if key not in self.k:
            self.k[key] = like.new_zeros((0, *like.shape[1:]))
            self.v[key] = like.new_zeros((0, *like.shape[1:]))
            self.written[key] = torch.zeros(0, dtype=torch.bool, device=like.device)
        extra = length - self.k[key].shape[0]
        if extra > 0:
            self.k[key] = torch.cat([self.k[key], like.new_zeros((extra, *like.shape[1:]))])
            self.v[key] = torch.cat([self.v[key], like.new_zeros((extra, *like.shape[1:]))])
            self.written[key] = torch.cat([self.written[key], self.written[key].new_zeros(extra)])

    def write(self, layer: int, slot: int, positions: list[int], k: Tensor, v: Tensor) -> None:
        key = (layer, slot)
        self._grow(key, max(positions) + 1, k)
        self.k[key][positions] = k
        self.v[key][positions] = v
        self.written[key][positions] = True

    def read(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """K, V ``[length, kv_heads, d]`` of positions ``0 .. length-1``; all of them must have been written."""
        key = (layer, slot)
        if key not in self.k or self.k[key].shape[0] < length or not bool(self.written[key][:length].all()):
            raise MissingKVError(
                f"layer {layer} slot {slot}: KV of a position < {length} was never written "
                "(an early exit under a KV policy that needs full depth?)"
            )
        return self.k[key][:length], self.v[key][:length]

    def copy_position(self, position: int, from_slot: int, to_slots: Sequence[int]) -> None:
        """Copy-on-exit: the KV of ``position`` in ``from_slot`` into ``to_slots``, every layer."""
        for layer, slot in [key for key in self.k if key[1] == from_slot]:
            if not (position < len(self.written[layer, slot]) and bool(self.written[layer, slot][position])):
                raise MissingKVError(f"layer {layer} slot {slot}: no KV at position {position} to copy")
            k = self.k[layer, slot][position : position + 1]  # [1, kvh, d]
            v = self.v[layer, slot][position : position + 1]
            for to in to_slots:
                self.write(layer, to, [position], k, v)

    def access(self, positions: Sequence[int], slot: int) -> DenseKV:
        return DenseKV(self, positions, slot)


class DenseKV:
    """``KVAccess`` for one request's tokens (consecutive or single positions), all in one depth slot."""

    def __init__(self, cache: DenseKVCache, positions: Sequence[int], slot: int) -> None:
        self.cache, self.positions, self.slot = cache, list(positions), slot

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.cache.write(layer, self.slot, self.positions, k, v)
        length = max(self.positions) + 1
        keys, values = self.cache.read(layer, self.slot, length)  # [L, kvh, d]
        rep = q.shape[1] // keys.shape[1]
        ct = compute_dtype(q.dtype)
        keys = keys.repeat_interleave(rep, dim=1).to(ct)  # [L, h, d]: query head i uses kv head i // rep
        values = values.repeat_interleave(rep, dim=1).to(ct)  # [L, h, d]
        scores = torch.einsum("nhd,lhd->hnl", q.to(ct), keys) / math.sqrt(q.shape[-1])  # [h, N, L]
        pos = torch.tensor(self.positions, device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= pos[:, None]  # [N, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = scores.softmax(dim=-1)  # [h, N, L]
        return torch.einsum("hnl,lhd->nhd", probs, values).to(q.dtype)  # [N, h, d]


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """``q [B, h, T, d]``, ``k, v [B, kvh, L, d]``, bool ``mask [B, 1, T, L]`` (True = visible) -> ``[B, h, T, d]``.
    Query head i uses kv head ``i // (h / kvh)`` (grouped-query attention, without materialising repeats)."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]), enable_gqa=gqa)


class DecodeKV:
    """``KVAccess`` for decode tokens: one token per request, each in its own depth slot, over a paged pool.

    ``lines [N]`` are the requests' lines in the device block tables, ``positions [N]`` and ``slots [N]`` the
    tokens' positions and depth slots (all long, on the pool's device). ``length`` bounds every position + 1
    (a context bucket chosen on the host: positions beyond a token's own are masked). The flat pool rows of the
    writes and of every context position are computed once per op, on the device, and reused by every layer.
    """

    def __init__(
        self, pool: PagedKVPool, tables: Tensor, lines: Tensor, positions: Tensor, slots: Tensor, length: int
    ) -> None:
        self.pool = pool
        bs, nb = pool.block_size, pool.num_blocks
        j = torch.arange(length, device=positions.device)  # [L]
        base = slots * nb  # [N]
        own = tables.index_select(0, lines)  # [N, columns]
        ctx_blocks = own[:, : -(-length // bs)].repeat_interleave(bs, dim=1)[:, :length]  # [N, L]
        self.context_rows = (base[:, None] + ctx_blocks) * bs + (j % bs)[None, :]  # [N, L]
        write_block = own.gather(1, (positions // bs)[:, None])[:, 0]  # [N]
        self.write_rows = (base + write_block) * bs + positions % bs  # [N]
        self.mask = (j[None, :] <= positions[:, None])[:, None, None, :]  # [N, 1, 1, L]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n, kvh, d = k.shape
        kp, vp = self.pool.k_rows[layer], self.pool.v_rows[layer]  # [slots * blocks * block_size, kvh, d]
        kp.index_copy_(0, self.write_rows, k)
        vp.index_copy_(0, self.write_rows, v)
        length = self.context_rows.shape[1]
        rows = self.context_rows.view(-1)
        kc = kp.index_select(0, rows).view(n, length, kvh, d).transpose(1, 2)  # [N, kvh, L, d]
        vc = vp.index_select(0, rows).view(n, length, kvh, d).transpose(1, 2)
        return _sdpa(q[:, :, None, :], kc, vc, self.mask)[:, :, 0, :]  # [N, h, d]


class PagedKV:
    """``KVAccess`` over a paged pool for tokens of many requests, each with its own depth slot.

    Tokens alone in their (request, slot) group (decode) are attended as one padded batch with a mask; groups of
    several tokens (prompt chunks: consecutive positions of one request) are attended group by group. The
    gather indices are built once per call and reused by every layer.
    """

    def __init__(
        self,
        pool: PagedKVPool,
        tables: BlockTables,
        rids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
    ) -> None:
        self.pool = pool
        dev = pool.device
        blocks: list[int] = []
        offs: list[int] = []
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (rid, p, s) in enumerate(zip(rids, positions, slots, strict=True)):
            (b,), (o,) = pool.locate(tables.table(rid), [p])
            blocks.append(b)
            offs.append(o)
            groups.setdefault((rid, s), []).append(i)

        def lt(xs: Sequence[int]) -> Tensor:
            return torch.tensor(list(xs), dtype=torch.long, device=dev)

        self._write = (lt(slots), lt(blocks), lt(offs))  # [N] each
        self._write_rows: Tensor | None = None  # flat pool rows, built on first use (device-side arithmetic)
        self._single_rows = torch.empty(0, dtype=torch.long)
        self._multi_rows: list[Tensor] = []
        # Decode-like tokens: one padded batch. Blocks [n1, L], offsets [L], mask [n1, 1, 1, L].
        single = [idx[0] for idx in groups.values() if len(idx) == 1]
        self._single: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None
        if single:
            pos = lt([positions[i] for i in single])  # [n1]
            length = int(pos.max()) + 1
            sb, so = self._context(pool, [tables.table(rids[i]) for i in single], pos.tolist(), length)
            mask = (torch.arange(length, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
            self._single = (lt(single), lt([slots[i] for i in single]), sb, so, mask)
        # Prompt chunks: per group (token indices [T], slot, blocks [L], offsets [L], mask [1, 1, T, L]).
        self._multi: list[tuple[Tensor, int, Tensor, Tensor, Tensor]] = []
        for (rid, slot), idx in groups.items():
            if len(idx) > 1:
                pos = lt([positions[i] for i in idx])  # [T]
                length = int(pos.max()) + 1
                gb, go = self._context(pool, [tables.table(rid)], [length - 1], length)
                mask = (torch.arange(length, device=dev)[None, :] <= pos[:, None])[None, None]
                self._multi.append((lt(idx), slot, gb[0], go, mask))

    @staticmethod
    def _context(
        pool: PagedKVPool, tables: Sequence[Sequence[int]], last: Sequence[int], length: int
    ) -> tuple[Tensor, Tensor]:
        """Block ids ``[n, length]`` and offsets ``[length]`` of positions ``0 .. length-1`` in each table.

        Positions after ``last[i]`` are masked out by the caller; they may point at any block of the table.
        """
        bs = pool.block_size
        n_blocks = -(-length // bs)
        padded = []
        for table, p in zip(tables, last, strict=True):
            if len(table) * bs <= p:
                raise IndexError(f"position {p} beyond the block table ({len(table)} blocks of {bs})")
            head = list(table[:n_blocks])
            padded.append(head + [head[0]] * (n_blocks - len(head)))
        t = torch.tensor(padded, dtype=torch.long, device=pool.device)  # [n, n_blocks]
        j = torch.arange(length, device=pool.device)  # [L]
        return t[:, j // bs], j % bs

    def _flat(self, slots: Tensor, blocks: Tensor, offs: Tensor) -> Tensor:
        """Row indices into the ``[slots * blocks * block_size, kvh, d]`` view of one layer's pool."""
        return (slots * self.pool.num_blocks + blocks) * self.pool.block_size + offs

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kvh, d = k.shape[1], k.shape[2]
        # One layer's pool viewed as rows: a gather of whole [kvh, d] rows is a plain index_select (memcpy),
        # several times faster on CPU than advanced indexing over three index tensors.
        kp, vp = self.pool.k_rows[layer], self.pool.v_rows[layer]  # [slots * blocks * block_size, kvh, d]
        if self._write_rows is None:
            self._write_rows = self._flat(*self._write)
            if self._single is not None:
                idx, slots, blocks, offs, _ = self._single
                self._single_rows = self._flat(slots[:, None], blocks, offs[None, :])  # [n1, L]
            self._multi_rows = [self._flat(torch.tensor(s, device=b.device), b, o) for _, s, b, o, _ in self._multi]
        kp.index_copy_(0, self._write_rows, k)
        vp.index_copy_(0, self._write_rows, v)
        out = torch.empty_like(q)  # [N, h, d]
        if self._single is not None:
            idx, _, _, _, mask = self._single
            rows = self._single_rows
            n1, length = rows.shape
            kc = kp.index_select(0, rows.view(-1)).view(n1, length, kvh, d).transpose(1, 2)  # [n1, kvh, L, d]
            vc = vp.index_select(0, rows.view(-1)).view(n1, length, kvh, d).transpose(1, 2)
            o = _sdpa(q[idx][:, :, None, :], kc, vc, mask)  # [n1, h, 1, d]
            out[idx] = o[:, :, 0, :]
        for (gidx, _, _, _, gmask), grows in zip(self._multi, self._multi_rows):
            kc = kp.index_select(0, grows).transpose(0, 1)[None]  # [L, kvh, d] -> [1, kvh, L, d]
            vc = vp.index_select(0, grows).transpose(0, 1)[None]
            o = _sdpa(q[gidx].transpose(0, 1)[None], kc, vc, gmask)  # [1, h, T, d]
            out[gidx] = o[0].transpose(0, 1)
        return out
