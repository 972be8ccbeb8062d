"""What one forward pass needs to know about the ragged batch it computes.

A batch is the concatenation of B sequences' *new* tokens (T tokens in all). Sequence
``i`` contributes ``query_lens[i]`` new tokens, preceded in its KV cache by
``seq_lens[i] - query_lens[i]`` tokens computed in earlier steps (or served by the
prefix cache)::

    flat tokens:   | seq 0 new tokens | seq 1 new tokens | ... |
    query_start_loc: 0                q0               q0+q1 ...  (B + 1 entries)

    seq i's context (positions 0 .. seq_lens[i]-1), laid out in KV blocks:
        block_tables[i, j] = physical block holding positions j*bs .. j*bs+bs-1
        |<------ computed before ------>|<-- new (query) -->|
        0                 seq_lens[i]-query_lens[i]      seq_lens[i]

    slot_mapping[t] = block_tables[i, p // bs] * bs + p % bs   for flat token t at
    position p of sequence i: where that token's key/value are written.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (index 0: keys, 1: values). Each new token attends causally to every
position of its own sequence up to and including itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, on the model's device
    query_start_loc: list[int]  # [B + 1], host ints
    query_lens: list[int]  # [B]
    seq_lens: list[int]  # [B], context length after this step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int64, padded with 0
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)
