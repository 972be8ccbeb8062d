"""Per-request block tables on top of the block pool, and prefix-cache lookups.

Block ``j`` of a request holds the KV values of its positions ``j*bs .. j*bs + bs - 1``::

    all_token_ids:  [ b0: 0..bs-1 ][ b1: bs..2bs-1 ][ b2: partial ]
    block table:    [   id 7      ][    id 3       ][   id 12     ]
    block_hashes:   [ h0=H(None,b0)][ h1=H(h0,b1)  ]   (full blocks only; H also takes
                                                        how many positions are prompt)

Only blocks whose tokens are all computed are entered into the prefix cache. A lookup
never covers a request's last token: at least one token is always computed, so the
step that finishes the prompt has logits to sample from.

With a ``window`` (a model whose every layer attends to the last ``window`` positions
only), ``release_behind_window`` returns to the pool the blocks a request's next tokens
can no longer see: all their positions are below ``num_computed_tokens - window + 1``.
Their table entries become ``BEHIND_WINDOW``, a placeholder (block id 0) that keeps
positions and table indices aligned and that the model never reads::

    block table:    [ BEHIND_WINDOW ][ BEHIND_WINDOW ][ id 3 ][ id 12 ]
                                        first position visible ^  ^ next token
"""

from __future__ import annotations

from collections import Counter

from tokenmill.core.kv_cache.block_pool import BlockKey, BlockPool, KVBlock, hash_block
from tokenmill.core.request import Request

BEHIND_WINDOW = KVBlock(0)  # a released table entry; never in the pool, never read


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already in the cache
        self._num_released: dict[str, int] = {}  # leading entries that are BEHIND_WINDOW

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    @property
    def num_used_tokens(self) -> int:
        return self.pool.num_used_blocks * self.block_size

    def block_ids(self, req_id: str) -> tuple[int, ...]:
        return tuple(b.block_id for b in self._tables.get(req_id, ()))

    def _update_block_hashes(self, request: Request) -> None:
        hashes, tokens = request.block_hashes, request.all_token_ids
        while (len(hashes) + 1) * self.block_size <= len(tokens):
            hashes.append(hash_block(*self._block_key(request, len(hashes))))

    def _block_key(self, request: Request, j: int) -> BlockKey:
        """Full block ``j``'s prefix-cache key (``block_pool``): its parent's hash, its
        tokens, and how many of its positions are prompt."""
        bs = self.block_size
        parent = request.block_hashes[j - 1] if j else None
        prompt_positions = min(max(request.num_prompt_tokens - j * bs, 0), bs)
        return parent, tuple(request.all_token_ids[j * bs:(j + 1) * bs]), prompt_positions

    def find_cached_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of leading full blocks of ``request`` present in the cache."""
        if not self.enable_prefix_caching:
            return []
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = []
        for j, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, self._block_key(request, j))
            if block is None:
                break
            found.append(block)
        return found

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          cached_blocks: list[KVBlock] = ()) -> int:  # type: ignore[assignment]
        """Free blocks that ``allocate`` would take (cache hits that are free count too)."""
        have = len(self._tables.get(request.req_id, ())) + len(cached_blocks)
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - have
        return max(need, 0) + sum(1 for b in cached_blocks if b.ref_count == 0)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     cached_blocks: list[KVBlock] = ()) -> bool:  # type: ignore[assignment]
        """Whether ``allocate`` with these arguments would succeed now."""
        return (self.num_blocks_needed(request, num_new_tokens, cached_blocks)
                <= self.pool.num_free_blocks)

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_blocks: list[KVBlock] = ()) -> bool:  # type: ignore[assignment]
        """Give ``request`` room for ``num_new_tokens`` more tokens; False if blocks run out.

        ``cached_blocks`` (from ``find_cached_blocks``, for a request with nothing computed)
        become the head of its table; the caller advances ``num_computed_tokens`` past them.
        """
        if not self.can_allocate(request, num_new_tokens, cached_blocks):
            return False
        table = self._tables.setdefault(request.req_id, [])
        if cached_blocks:
            assert not table, "cache hits only at the start of a table"
            self.pool.touch(list(cached_blocks))
            table.extend(cached_blocks)
            self._num_cached_blocks[request.req_id] = len(cached_blocks)
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        missing = -(-total // self.block_size) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Enter the request's newly completed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.req_id)
        if not table:
            return
        self._update_block_hashes(request)
        done = self._num_cached_blocks.get(request.req_id, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        for j in range(done, num_full):
            if table[j] is BEHIND_WINDOW:
                continue
            self.pool.cache(table[j], request.block_hashes[j], self._block_key(request, j))
        self._num_cached_blocks[request.req_id] = max(done, num_full)

    def release_behind_window(self, request: Request) -> None:
        """Free the blocks the request's next tokens cannot see (see the module docstring;
        nothing without a window). Call after ``cache_computed_blocks``, so that a full
        block enters the prefix cache before it leaves the table."""
        if self.window is None:
            return
        table = self._tables.get(request.req_id)
        if not table:
            return
        first_visible = request.num_computed_tokens - self.window + 1
        end = min(max(first_visible, 0) // self.block_size, len(table))
        start = self._num_released.get(request.req_id, 0)
        if end <= start:
            return
        behind = table[start:end]
        table[start:end] = [BEHIND_WINDOW] * (end - start)
        self._num_released[request.req_id] = end
        self.pool.free(behind)

    def trim(self, request: Request) -> None:
        """Free the blocks past the one that holds the request's last token: they were
        allocated for speculative drafts that were rejected. The tail goes first."""
        table = self._tables.get(request.req_id)
        keep = -(-request.num_tokens // self.block_size)
        if table and len(table) > keep:
            surplus = table[keep:]
            del table[keep:]
            self.pool.free(list(reversed(surplus)))

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail is freed first so it is evicted first."""
        table = self._tables.pop(request.req_id, None)
        self._num_cached_blocks.pop(request.req_id, None)
        self._num_released.pop(request.req_id, None)
        if table:
            self.pool.free([b for b in reversed(table) if b is not BEHIND_WINDOW])

    def check_integrity(self) -> None:
        """free + used == total, and every block's ref count equals the tables holding it."""
        self.pool.check_integrity()
        holders = Counter(b.block_id for table in self._tables.values() for b in table
                          if b is not BEHIND_WINDOW)
        for block in self.pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count {block.ref_count} != "
                f"{holders.get(block.block_id, 0)} tables"
            )
