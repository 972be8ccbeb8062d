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

Which attention computes a new token: the first ``prefill_lens[i]`` new tokens of sequence
``i`` go to the prefill attention (one causal call over them), the rest to the decode
attention, each as its own row, exactly as if it were decoded alone over the positions
before it::

    seq i's new tokens:  | prefill_lens[i] (prefill attention) | one decode row each |

The engine gives prompt positions to the prefill attention and output positions (decodes,
speculative drafts being verified, outputs recomputed after preemption) to the decode
attention, so a position's arithmetic never depends on the schedule (``docs/speculative.md``).
``prefill_lens`` None: a sequence with one new token decodes, one with several prefills.

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
    prefill_lens: list[int] | None = None  # [B], each in 0 .. query_lens[i]; see above

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def num_prefill_tokens(self, i: int) -> int:
        """How many of sequence ``i``'s new tokens (the first ones) the prefill attention
        computes; the decode attention computes the others, one row each."""
        if self.prefill_lens is None:
            return self.query_lens[i] if self.query_lens[i] > 1 else 0
        return self.prefill_lens[i]

    def prefill_span(self, i: int) -> tuple[int, int, int]:
        """Sequence ``i``'s prefill tokens as a flat range ``[start, end)``, and its context
        length up to and including them."""
        start = self.query_start_loc[i]
        n = self.num_prefill_tokens(i)
        return start, start + n, self.seq_lens[i] - self.query_lens[i] + n
