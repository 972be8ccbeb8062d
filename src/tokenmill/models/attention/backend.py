"""Paged attention: rotate q and k, write the new keys/values into the block cache, attend.

A model builds one ``AttentionBackend`` and hands it to every layer: ``SdpaAttention``
(``sdpa``: PyTorch's ops) or ``NativeAttention`` (``native``: the
engine's kernels). ``backend.plan`` turns an ``AttentionMetadata`` into the index tensors
every layer needs; it runs once per forward pass, so layers never touch host lists or sync
with the device. New tokens split into two groups, each computed by the backend's decode
or prefill attention over its own sub-plan, as ``AttentionMetadata.prefill_lens`` says:

- *decode* rows (a decoded token, a speculative draft being verified, an output being
  recomputed; by default a sequence's one new token): all of them go through ONE call,
  each over its own context, so a token computed in a row of several of one sequence
  gets the very bits it would get decoded alone. The native kernel
  reads the blocks in place, each row over its own length. SDPA takes them padded:
  the blocks are gathered into ``[Bd, L, kv_heads, D]`` with ``L`` the longest context,
  and a length mask hides each row's padding::

      row b:  | k_0 k_1 ... k_{len_b - 1} | padding (masked) |     L = max(len_b)

  GQA without copying K/V: the ``G = heads / kv_heads`` query heads that share one KV head
  become G query rows of that head, ``q[Bd, kv_heads, G, D]`` against ``k[Bd, kv_heads, L, D]``.
- *prefill* sequences (the first ``prefill_lens`` new tokens: a prompt or a chunk of
  one; by default a sequence's several new tokens): the native kernel (bfloat16 on
  AVX512-BF16 without AMX, heads of 64, 128 or 256) takes all of them in ONE call over the
  blocks in place; SDPA one call each. Causal with an offset: new token ``i`` (position
  ``ctx + i``) sees keys ``0 .. ctx + i``::

      keys ->   0 ....... ctx-1 | ctx ......... seq_len-1
      query 0:  x x x x x x x x | x
      query 1:  x x x x x x x x | x x
      ...                         (lower triangle)

  With SDPA a sequence with no earlier context (``ctx == 0``) attends over its fresh k/v
  directly.

The result is identical to full causal attention over each sequence's tokens (tested).

Sliding window (a backend built with ``window=W``): a query at position ``p`` sees keys
``p - W < j <= p`` only, and reads only the blocks that hold them: a decode's from the
block of its first visible key (the native kernel starts there; SDPA's block table is
shifted to start there, ``_plan_decode``), a prefill's from the block of its first
query's first visible key (SDPA; the native prefill kernel takes no window).

NOTE: SDPA reads padded keys and then masks them, so their weight is exactly 0, but 0 * NaN
is NaN: the KV cache must hold finite values everywhere (allocate it with ``torch.zeros``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from tokenmill.models.attention.metadata import AttentionMetadata

D = TypeVar("D")
P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class AttentionPlan(Generic[D, P]):
    """Per-forward index tensors shared by every layer (see the module docstring)."""

    slot_mapping: torch.Tensor  # [T]: where each new token's key and value go
    # [Bd] flat indices of the decode rows' tokens; None where every token is one, in flat
    # order, or none is
    decode_token_idx: torch.Tensor | None
    decode: D | None  # the decode attention's sub-plan; None: no decode sequence
    prefill: P | None  # the prefill attention's sub-plan; None: no prefill sequence
    # whether every decode row is the only one of its sequence, so that none attends to
    # another row's new key and value (False: a speculative verification's rows)
    decodes_one_per_sequence: bool


class DecodeAttention(Protocol[D]):
    def plan(self, block_tables: torch.Tensor, seq_lens: list[int],
             num_cache_blocks: int) -> D:
        """The sub-plan of the decode sequences: their ``block_tables [Bd, nb]`` (int64,
        ``nb`` blocks for the longest) and context lengths; ``num_cache_blocks``: the
        blocks of each layer's cache tensor (for an attention that gathers them)."""
        ...

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: D,
                 scale: float) -> torch.Tensor:
        """``q [Bd, heads, D]`` -> ``[Bd, heads * D]``."""
        ...


class PrefillAttention(Protocol[P]):
    reads_new_kv: bool  # whether it reads the new keys and values from ``k, v``
    # whether each token's result is the same whatever the chunk it is computed in (its
    # own keys only, in one order), so prompts may be chunked at any boundary
    row_invariant: bool

    def plan(self, md: AttentionMetadata, rows: list[int], num_cache_blocks: int) -> P:
        """The sub-plan of the prefill sequences, ``rows`` of ``md``."""
        ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 kv_cache: torch.Tensor, plan: P, scale: float, out: torch.Tensor) -> None:
        """Write the attention of the prefill tokens' rows of ``q [T, heads, D]`` into the
        same rows of ``out [T, heads * D]``."""
        ...


class AttentionBackend(ABC, Generic[D, P]):
    """The attention of every layer of one model: ``num_heads`` query heads of
    ``head_dim`` over ``num_kv_heads`` KV heads, by a ``decode`` and a ``prefill``
    attention fixed when the backend is built."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 decode: DecodeAttention[D], prefill: PrefillAttention[P],
                 scale: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.qk_size = self.q_size + num_kv_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else scale  # of q . k
        self.decode = decode
        self.prefill = prefill

    @abstractmethod
    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, plan: AttentionPlan[D, P]) -> torch.Tensor:
        """Attention output ``[T, heads * D]`` for ``qkv [T, (heads + 2 kv_heads) D]`` (the
        fused projection's): q and k rotated by ``cos, sin`` (``RotaryEmbedding.cos_sin``),
        the new k and v stored in ``kv_cache`` (one layer's ``[2, blocks, block_size,
        kv_heads, D]``) at ``plan.slot_mapping``."""

    def plan(self, md: AttentionMetadata, num_cache_blocks: int) -> AttentionPlan[D, P]:
        """The plan of one forward pass; ``num_cache_blocks``: the blocks of each layer's
        cache tensor. Each token the metadata gives the decode attention is one decode row
        over its own context (``AttentionMetadata.prefill_lens``)."""
        seqs: list[int] = []  # per decode row: its sequence, flat token and context length
        tokens: list[int] = []
        lens: list[int] = []
        prefill_rows = []
        for i, (start, q_len, seq_len) in enumerate(
                zip(md.query_start_loc, md.query_lens, md.seq_lens, strict=False)):
            first = md.num_prefill_tokens(i)
            if first:
                prefill_rows.append(i)
            for j in range(first, q_len):
                seqs.append(i)
                tokens.append(start + j)
                lens.append(seq_len - q_len + j + 1)
        decode = decode_idx = None
        if seqs:
            nb = -(-max(lens) // md.block_size)
            if seqs == list(range(md.num_seqs)) and len(seqs) == md.query_start_loc[-1]:
                tables = md.block_tables[:, :nb]  # one decode per sequence, nothing else
            else:
                device = md.slot_mapping.device
                tables = md.block_tables[torch.tensor(seqs, dtype=torch.long, device=device),
                                         :nb]
                if prefill_rows:  # else every token is a decode row, in flat order
                    decode_idx = torch.tensor(tokens, dtype=torch.long, device=device)
            decode = self._plan_decode(tables, lens, md.block_size, num_cache_blocks)
        prefill = (self.prefill.plan(md, prefill_rows, num_cache_blocks) if prefill_rows
                   else None)
        return AttentionPlan(md.slot_mapping, decode_idx, decode, prefill,
                             len(set(seqs)) == len(seqs))

    def _plan_decode(self, block_tables: torch.Tensor, seq_lens: list[int], block_size: int,
                     num_cache_blocks: int) -> D:
        """The decode sub-plan (see ``DecodeAttention.plan``); a windowed backend narrows
        the tables to the window."""
        return self.decode.plan(block_tables, seq_lens, num_cache_blocks)

    def _attend_with_prefills(self, q: torch.Tensor, k: torch.Tensor | None,
                              v: torch.Tensor | None, kv_cache: torch.Tensor,
                              plan: AttentionPlan[D, P]) -> torch.Tensor:
        """``[T, heads * D]`` for ``q [T, heads, D]`` of a batch with prefill sequences (a
        batch of decodes alone is one ``self.decode`` call), once the new keys and values
        are in ``kv_cache``; ``k, v [T, kv_heads, D]`` (the new ones) may be None unless the
        prefill attention ``reads_new_kv``."""
        assert plan.prefill is not None, "a batch of decodes alone takes self.decode"
        out = q.new_empty(q.shape[0], self.q_size)
        if plan.decode is not None:
            idx = plan.decode_token_idx
            out.index_copy_(0, idx, self.decode(q[idx], kv_cache, plan.decode, self.scale))
        self.prefill(q, k, v, kv_cache, plan.prefill, self.scale, out)
        return out
