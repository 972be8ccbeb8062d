from __future__ import annotations

import pytest

from tokenmill.core.kv_cache.block_pool import BlockPool, hash_block


def test_allocate_free_and_eviction_order() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.allocate(1)
    pool.free(list(reversed(b)))  # tail first
    pool.free(list(reversed(a)))
    # least recently freed first: b's tail, b's head, a's tail, a's head
    order = [blk.block_id for blk in pool.allocate(4)]
    assert order == [b[1].block_id, b[0].block_id, a[1].block_id, a[0].block_id]
    pool.check_integrity()


def test_cached_free_block_is_hit_then_evicted_when_reused() -> None:
    pool = BlockPool(2)
    [blk] = pool.allocate(1)
    key = (None, (1, 2, 3))
    h = hash_block(*key)
    pool.cache(blk, h, key)
    pool.free([blk])
    assert pool.lookup(h, key) is blk  # cached-free still findable
    assert pool.lookup(h, (None, (1, 2, 4))) is None  # confirmed against token ids
    pool.touch([blk])
    assert blk.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([blk])
    pool.allocate(2)  # reuse evicts the key
    assert pool.lookup(h, key) is None
    pool.check_integrity()


def test_hash_collision_never_serves_wrong_block() -> None:
    pool = BlockPool(1)
    [blk] = pool.allocate(1)
    pool.cache(blk, 42, (None, (7, 7)))
    assert pool.lookup(42, (None, (8, 8))) is None
    assert pool.lookup(42, (None, (7, 7))) is blk


def test_double_free_is_caught() -> None:
    pool = BlockPool(1)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)
