"""The pool of physical KV blocks, the prefix-cache index and the eviction order.

Every block is in exactly one of three states::

    used         ref_count > 0               (in some request's block table)
    cached-free  ref_count == 0, has a key   (in the free queue AND in the hash index)
    free         ref_count == 0, no key      (in the free queue only)

The free queue's order *is* the eviction order: allocation takes from its head (least
recently freed first), freeing appends to its tail. A cached-free block that is hit
again leaves the queue wherever it is (O(1), the queue is an ordered dict).

A full block's key is ``(parent_hash, token_ids, prompt_positions)`` and its hash is
``hash(key)``, chained over all blocks before it. ``prompt_positions`` (how many of the
block's positions are its request's prompt, the others being output) is part of the key
because the two kinds of position are computed by different attention kernels (see
``AttentionMetadata.prefill_lens``): a hit serves the very bits the block would get
computed, so a request's tokens are the same with or without prefix-cache hits; a lookup
by hash is confirmed against the stored key, so a hash collision can never serve wrong KV
values.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockKey = tuple[int | None, tuple[int, ...], int]


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...],
               prompt_positions: int) -> int:
    return hash((parent_hash, token_ids, prompt_positions))


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def lookup(self, block_hash: int, key: BlockKey) -> KVBlock | None:
        """The cached block holding exactly ``key``, if any (does not take a reference)."""
        block = self._cached.get(block_hash)
        if block is None or block.key != key:
            return None
        return block

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting their cache keys."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; unreferenced ones join the queue's tail in order."""
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: int, key: BlockKey) -> None:
        """Register a full, computed block; the first block with a given hash keeps it."""
        if block.key is not None:
            return
        block.key, block.block_hash = key, block_hash
        self._cached.setdefault(block_hash, block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.key = block.block_hash = None

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used == total and every index is consistent."""
        used = [b for b in self.blocks if b.ref_count > 0]
        assert len(used) + len(self._free) == self.num_blocks, "free + used != total"
        for block_id, block in self._free.items():
            assert block.block_id == block_id and block.ref_count == 0, "free block in use"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash and block.key is not None, "stale cache entry"
