from __future__ import annotations

import pytest

from tokenmill.core.kv_cache.block_pool import BlockPool, hash_block
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.request import EngineCoreRequest, Request
from tokenmill.sampling_params import SamplingParams


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
    key = (None, (1, 2, 3), 3)
    h = hash_block(*key)
    pool.cache(blk, h, key)
    pool.free([blk])
    assert pool.lookup(h, key) is blk  # cached-free still findable
    assert pool.lookup(h, (None, (1, 2, 4), 3)) is None  # confirmed against token ids
    pool.touch([blk])
    assert blk.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([blk])
    pool.allocate(2)  # reuse evicts the key
    assert pool.lookup(h, key) is None
    pool.check_integrity()


def test_hash_collision_never_serves_wrong_block() -> None:
    pool = BlockPool(1)
    [blk] = pool.allocate(1)
    pool.cache(blk, 42, (None, (7, 7), 2))
    assert pool.lookup(42, (None, (8, 8), 2)) is None
    assert pool.lookup(42, (None, (7, 7), 2)) is blk


def test_double_free_is_caught() -> None:
    pool = BlockPool(1)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)


def test_blocks_of_output_positions_never_serve_a_prompt() -> None:
    """A block is keyed by how many of its positions are prompt: output positions are
    computed by the decode attention, prompt ones by the prefill attention, so a block a
    request filled with its output must not serve another request's prompt (a multi-turn
    follow-up), though a request that ends the same way shares its prompt blocks."""
    def request(req_id: str, prompt: list[int]) -> Request:
        return Request(EngineCoreRequest(req_id, tuple(prompt),
                                         SamplingParams(max_tokens=8), frozenset()))

    manager = KVCacheManager(num_blocks=8, block_size=2)
    first = request("a", [1, 2, 3, 4])
    assert manager.allocate(first, 4)
    first.num_computed_tokens = 4
    for token in (5, 6):  # two outputs: a third full block, of output positions
        first.all_token_ids.append(token)
        first.output_token_ids.append(token)
        assert manager.allocate(first, 1)
        first.num_computed_tokens += 1
    manager.cache_computed_blocks(first)
    follow_up = request("b", [1, 2, 3, 4, 5, 6, 7])
    assert len(manager.find_cached_blocks(follow_up)) == 2  # the prompt's two blocks only
    same_prompt = request("c", [1, 2, 3, 4, 9])
    assert len(manager.find_cached_blocks(same_prompt)) == 2
