"""Paged attention (many requests, block tables, per-token depth slots) equals the dense one-request path."""

from __future__ import annotations

import random

import pytest
import torch

from cdb_model.attention import DenseKVCache, PagedKV
from cdb_model.kv import BlockTables, PagedKVPool
from cdb_scheduler.plan import KVUpdate


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_equals_dense_float64(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_req, layers, slots, heads, kv_heads, d, bs = 5, 2, 2, 4, 2, 8, 3
    max_len = 16
    per_req = -(-max_len // bs)
    ids = list(range(n_req * per_req + 2))
    rng.shuffle(ids)
    pool = PagedKVPool(layers, slots, len(ids), bs, kv_heads, d, dtype=torch.float64, device="cpu")
    tables = BlockTables()
    tables.apply(KVUpdate(r, tuple(ids[r * per_req : (r + 1) * per_req])) for r in range(n_req))
    dense = [DenseKVCache() for _ in range(n_req)]
    length = [0] * n_req
    for rnd in range(5):
        new = {r: rng.choice([1, 1, 4]) if rnd else rng.randint(1, 6) for r in range(n_req) if rng.random() < 0.8}
        for flip in (0, 1):  # every new position gets written in both slots
            rids, positions, slot_of = [], [], {}
            for r, k in new.items():
                slot_of[r] = (r + rnd + flip) % slots
                rids += [r] * k
                positions += list(range(length[r], length[r] + k))
            if not rids:
                continue
            order = list(range(len(rids)))
            rng.shuffle(order)  # tokens of a request need not be adjacent in the op
            rids = [rids[i] for i in order]
            positions = [positions[i] for i in order]
            paged = PagedKV(pool, tables, rids, positions, [slot_of[r] for r in rids])
            for layer in range(layers):
                q = torch.randn(len(rids), heads, d, generator=gen, dtype=torch.float64)
                k = torch.randn(len(rids), kv_heads, d, generator=gen, dtype=torch.float64)
                v = torch.randn(len(rids), kv_heads, d, generator=gen, dtype=torch.float64)
                out = paged.attend(layer, q, k, v)
                for r in new:
                    idx = [i for i, x in enumerate(rids) if x == r]
                    acc = dense[r].access([positions[i] for i in idx], slot_of[r])
                    ref = acc.attend(layer, q[idx], k[idx], v[idx])
                    torch.testing.assert_close(out[idx], ref, atol=1e-12, rtol=1e-12)
        for r, k in new.items():
            length[r] += k


def test_dense_attention_is_causal_softmax() -> None:
    """DenseKV against a direct formula: token i sees positions 0..i, scale 1/sqrt(d), GQA head i -> i // 2."""
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, d = 5, 4, 2, 8
    q = torch.randn(n, heads, d, generator=gen, dtype=torch.float64)
    k = torch.randn(n, kv_heads, d, generator=gen, dtype=torch.float64)
    v = torch.randn(n, kv_heads, d, generator=gen, dtype=torch.float64)
    out = DenseKVCache().access(range(n), 0).attend(0, q, k, v)
    for i in range(n):
        for h in range(heads):
            w = torch.softmax(k[: i + 1, h // 2] @ q[i, h] / d**0.5, dim=0)
            torch.testing.assert_close(out[i, h], w @ v[: i + 1, h // 2])
