"""KV policies: slot mapping, block tables, copy-on-exit."""

from __future__ import annotations

import pytest
import torch

from cdb_model.attention import DenseKVCache
from cdb_model.kv import BlockTables, KVLayout, KVPolicy, PagedKVPool
from cdb_scheduler.plan import KVUpdate


def test_slot_mapping() -> None:
    r = 5
    assert [KVLayout(KVPolicy.DEPTH_INDEXED, r).slot(s) for s in range(r)] == [0, 1, 2, 3, 4]
    assert [KVLayout(KVPolicy.LAST_EXITED, r).slot(s) for s in range(r)] == [0, 1, 2, 3, 4]
    assert [KVLayout(KVPolicy.SINGLE, r).slot(s) for s in range(r)] == [0] * 5
    assert [KVLayout(KVPolicy.FIRST_THEN_SHARED, r, 3).slot(s) for s in range(r)] == [0, 1, 2, 2, 2]
    assert [KVLayout(p, r, 3).n_slots for p in KVPolicy] == [5, 5, 1, 3]
    assert [KVLayout(p, r).copies_on_exit for p in KVPolicy] == [False, True, False, False]
    assert KVPolicy("first_then_shared") is KVPolicy.FIRST_THEN_SHARED
    with pytest.raises(ValueError):
        KVLayout(KVPolicy.SINGLE, r).slot(r)
    with pytest.raises(ValueError):
        KVLayout(KVPolicy.FIRST_THEN_SHARED, r, r + 1)


def test_block_tables() -> None:
    t = BlockTables()
    t.apply([KVUpdate(1, (4, 2)), KVUpdate(2, (7,))])
    t.apply([KVUpdate(1, (9,))])
    assert t.table(1) == [4, 2, 9] and t.table(2) == [7]
    t.apply([KVUpdate(1, (3,), reset=True)])
    assert t.table(1) == [3]
    t.release([1, 5])
    assert 1 not in t and 2 in t and len(t) == 1
    with pytest.raises(KeyError, match="request 1"):
        t.table(1)


def test_copy_on_exit() -> None:
    pool = PagedKVPool(2, 4, 6, 2, 1, 3, dtype=torch.float32, device="cpu")
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    k0, v0 = pool.k.clone(), pool.v.clone()
    table = [5, 1, 3]
    pool.copy_on_exit(table, position=3, from_slot=1)  # block table[1] = 1, offset 1
    for s in range(4):
        src = min(s, 1)  # slots 0, 1 keep their KV; 2, 3 receive slot 1's
        torch.testing.assert_close(pool.k[:, s, 1, 1], k0[:, src, 1, 1])
        torch.testing.assert_close(pool.v[:, s, 1, 1], v0[:, src, 1, 1])
    mask = torch.ones(pool.k.shape[:4], dtype=torch.bool)
    mask[:, :, 1, 1] = False
    assert torch.equal(pool.k[mask], k0[mask]) and torch.equal(pool.v[mask], v0[mask])  # nothing else moved
    pool.copy_on_exit(table, position=0, from_slot=3)  # deepest slot: nothing to copy
    assert torch.equal(pool.k[mask], k0[mask])


def test_dense_copy_position() -> None:
    cache = DenseKVCache()
    k = torch.randn(3, 1, 2)
    for s in range(3):
        cache.write(0, s, [0, 1], k[:2], k[:2] * 2)
    cache.write(0, 0, [2], k[2:], k[2:] * 2)
    cache.copy_position(2, 0, [1, 2])
    for s in range(3):
        ks, vs = cache.read(0, s, 3)
        torch.testing.assert_close(ks, k)
        torch.testing.assert_close(vs, k * 2)
