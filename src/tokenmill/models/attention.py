"""Paged attention: write the new keys/values into the block cache, then attend.

``plan_attention`` turns an ``AttentionMetadata`` into the index tensors every layer needs;
it runs once per forward pass, so layers never touch host lists or sync with the device.
Sequences split into two groups:

- *decode* sequences (one new token): all of them go through ONE call. With a native
  decode kernel (``tokenmill.kernels``: the engine's default on CPU) that call reads the
  blocks in place, each sequence over its own length. Without one it is a padded SDPA
  call: the blocks are gathered into ``[Bd, L, kv_heads, D]`` with ``L`` the longest
  context, and a length mask hides each row's padding::

      row b:  | k_0 k_1 ... k_{len_b - 1} | padding (masked) |     L = max(len_b)

  GQA without copying K/V: the ``G = heads / kv_heads`` query heads that share one KV head
  become G query rows of that head, ``q[Bd, kv_heads, G, D]`` against ``k[Bd, kv_heads, L, D]``.
- *prefill* sequences (several new tokens, a prompt or a chunk of one): with a native
  prefill kernel (bfloat16 on AVX512-BF16) all of them in ONE call over the blocks in
  place; else one SDPA call each. Causal with an offset: new token ``i`` (position
  ``ctx + i``) sees keys ``0 .. ctx + i``::

      keys ->   0 ....... ctx-1 | ctx ......... seq_len-1
      query 0:  x x x x x x x x | x
      query 1:  x x x x x x x x | x x
      ...                         (lower triangle)

  A sequence with no earlier context (``ctx == 0``) attends over its fresh k/v directly.

The result is identical to full causal attention over each sequence's tokens (tested).

NOTE: padded keys are read and then masked, so their weight is exactly 0, but 0 * NaN is NaN:
the KV cache must hold finite values everywhere (allocate it with ``torch.zeros``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.models.attention_metadata import AttentionMetadata


@dataclass(slots=True)
class PrefillSeq:
    start: int  # flat token range [start, end) of this sequence's new tokens
    end: int
    seq_len: int
    blocks: torch.Tensor | None  # [2 * ceil(seq_len / bs)] as _kv_rows; None when ctx == 0
    mask: torch.Tensor | None  # [q_len, seq_len] additive (0 or -inf); None when ctx == 0


@dataclass(slots=True)
class AttentionPlan:
    """Per-forward index tensors shared by every layer (see the module docstring)."""

    slot_mapping: torch.Tensor  # [T]
    decode_token_idx: torch.Tensor | None  # [Bd] flat indices; None: every token is a decode
    # [2 * Bd * nb]: the keys' blocks row-major, then the values' (see ``_gather_blocks``);
    # None: no decode sequence
    decode_block_ids: torch.Tensor | None
    num_decode_seqs: int  # Bd
    decode_len: int  # L, the longest decode context
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, L] additive; None: all contexts are L long
    prefills: list[PrefillSeq]
    # With a native decode kernel (then decode_block_ids and decode_mask stay None):
    native_decode: Callable | None = None  # (q, k_cache, v_cache, tables, lens, scale)
    decode_tables: torch.Tensor | None = None  # [Bd, nb] int32
    decode_seq_lens: torch.Tensor | None = None  # [Bd] int32
    # With a native prefill kernel (then prefills stays empty):
    # (q, k_cache, v_cache, tables, query_ranges, lens, scale, out)
    native_prefill: Callable | None = None
    prefill_tables: torch.Tensor | None = None  # [Bp, nb] int32
    prefill_query_ranges: torch.Tensor | None = None  # [Bp, 2] int32, flat [start, end)
    prefill_seq_lens: torch.Tensor | None = None  # [Bp] int32


def plan_attention(md: AttentionMetadata, dtype: torch.dtype, num_cache_blocks: int,
                   native_decode: Callable | None = None,
                   native_prefill: Callable | None = None) -> AttentionPlan:
    """Index tensors and masks for one forward pass; ``dtype``: the model's (masks are
    additive, 0 where a key is visible and -inf elsewhere, the form SDPA uses natively);
    ``num_cache_blocks``: the blocks of each layer's cache tensor; ``native_decode`` and
    ``native_prefill``: the attention kernels of ``tokenmill.kernels``, or None for SDPA."""
    device = md.slot_mapping.device
    bs = md.block_size
    decode_rows = [i for i, q in enumerate(md.query_lens) if q == 1]
    decode_blocks = decode_idx = decode_mask = decode_tables = decode_seq_lens = None
    decode_len = 0
    if decode_rows:
        lens = [md.seq_lens[i] for i in decode_rows]
        decode_len = max(lens)
        nb = -(-decode_len // bs)
        if len(decode_rows) == md.num_seqs:
            decode_blocks = md.block_tables[:, :nb]
        else:
            rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
            decode_blocks = md.block_tables[rows, :nb]
            decode_idx = torch.tensor(
                [md.query_start_loc[i] for i in decode_rows], dtype=torch.long, device=device
            )
        if native_decode is not None:
            decode_tables = decode_blocks.to(torch.int32)
            decode_seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            decode_blocks = None
        elif min(lens) != decode_len:
            lens_t = torch.tensor(lens, dtype=torch.long, device=device)
            keys = torch.arange(decode_len, device=device)
            visible = (keys[None, :] < lens_t[:, None]).view(len(lens), 1, 1, decode_len)
            decode_mask = _additive(visible, dtype)
    prefill_rows = [i for i, q in enumerate(md.query_lens) if q > 1]
    prefills, native = [], {}
    if prefill_rows and native_prefill is not None:
        native = _plan_native_prefill(md, prefill_rows, native_prefill)
    else:
        prefills = [_plan_prefill(md, i, dtype, num_cache_blocks) for i in prefill_rows]
    return AttentionPlan(
        slot_mapping=md.slot_mapping,
        decode_token_idx=decode_idx,
        decode_block_ids=None if decode_blocks is None else _kv_rows(decode_blocks.reshape(-1),
                                                                     num_cache_blocks),
        num_decode_seqs=len(decode_rows),
        decode_len=decode_len,
        decode_mask=decode_mask,
        prefills=prefills,
        native_decode=native_decode if decode_rows else None,
        decode_tables=decode_tables,
        decode_seq_lens=decode_seq_lens,
        **native,
    )


def _plan_native_prefill(md: AttentionMetadata, rows: list[int], kernel: Callable) -> dict:
    device = md.slot_mapping.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    nb = -(-max(md.seq_lens[i] for i in rows) // md.block_size)
    return dict(
        native_prefill=kernel,
        prefill_tables=md.block_tables[index, :nb].to(torch.int32),
        prefill_query_ranges=torch.tensor(
            [(md.query_start_loc[i], md.query_start_loc[i + 1]) for i in rows],
            dtype=torch.int32, device=device),
        prefill_seq_lens=torch.tensor([md.seq_lens[i] for i in rows], dtype=torch.int32,
                                      device=device),
    )


def _plan_prefill(md: AttentionMetadata, i: int, dtype: torch.dtype,
                  num_cache_blocks: int) -> PrefillSeq:
    start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
    seq_len = md.seq_lens[i]
    ctx = seq_len - (end - start)
    if ctx == 0:
        return PrefillSeq(start, end, seq_len, None, None)
    device = md.slot_mapping.device
    blocks = _kv_rows(md.block_tables[i, : -(-seq_len // md.block_size)], num_cache_blocks)
    query_pos = torch.arange(ctx, seq_len, device=device)
    visible = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
    return PrefillSeq(start, end, seq_len, blocks, _additive(visible, dtype))


def _kv_rows(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Rows of a cache viewed as ``[2 * num_blocks, block]``: the keys' blocks, then the
    values' (``_gather_blocks`` reads both in one call)."""
    return torch.cat((block_ids, block_ids + num_blocks))


def _gather_blocks(kv_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[2, n, block]``: keys and values of the blocks ``rows`` names (``_kv_rows``).

    ``F.embedding`` is a row gather, and the fastest one on CPU (about twice
    ``index_select`` along the cache's second dimension)."""
    return F.embedding(rows, kv_cache.view(2 * kv_cache.shape[1], -1)).view(2, len(rows) // 2,
                                                                             -1)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Store ``k, v [T, kv_heads, D]`` at ``plan.slot_mapping``, attend with ``q [T, heads, D]``.

    ``kv_cache`` is one layer's ``[2, num_blocks, block_size, kv_heads, D]``; returns
    ``[T, heads * D]``.
    """
    num_kv_heads, head_dim = k.shape[1:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, v)
    return attend(q, k, v, kv_cache, plan, scale)


def attend(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    kv_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """``paged_attention`` after the new keys and values are in ``kv_cache`` already;
    ``k`` and ``v`` (the new ones) may be None when ``plan.prefills`` is empty: only SDPA
    prefills read them."""
    num_tokens, num_heads, head_dim = q.shape
    decode_out = None
    if plan.decode_block_ids is not None or plan.native_decode is not None:
        decode_q = q if plan.decode_token_idx is None else q[plan.decode_token_idx]
        decode_out = _decode_attention(decode_q, kv_cache, plan, scale)
        if plan.decode_token_idx is None:
            return decode_out
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if decode_out is not None:
        out.index_copy_(0, plan.decode_token_idx, decode_out)
    if plan.native_prefill is not None:
        plan.native_prefill(q, kv_cache[0], kv_cache[1], plan.prefill_tables,
                            plan.prefill_query_ranges, plan.prefill_seq_lens, scale, out)
    for seq in plan.prefills:
        out[seq.start : seq.end] = _prefill_attention(
            q[seq.start : seq.end], k[seq.start : seq.end], v[seq.start : seq.end],
            kv_cache, seq, scale,
        )
    return out


def _decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """One call for every single-token sequence: ``q [Bd, heads, D]`` -> ``[Bd, heads * D]``
    (the native kernel over the blocks in place, else padded SDPA over gathered blocks)."""
    num_seqs, num_heads, head_dim = q.shape
    if plan.native_decode is not None:
        out = plan.native_decode(q, kv_cache[0], kv_cache[1], plan.decode_tables,
                                 plan.decode_seq_lens, scale)
        return out.view(num_seqs, num_heads * head_dim)
    num_kv_heads = kv_cache.shape[3]
    # [2, Bd * nb, bs * kvh * D] -> [2, Bd, nb * bs, kvh, D] -> k, v as [Bd, kvh, L, D] views
    kv = _gather_blocks(kv_cache, plan.decode_block_ids)
    kv = kv.view(2, num_seqs, -1, num_kv_heads, head_dim)[:, :, : plan.decode_len]
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=scale)
    return out.reshape(num_seqs, num_heads * head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
) -> torch.Tensor:
    """Causal attention for one sequence's ``q_len`` new tokens -> ``[q_len, heads*D]``.

    NOTE: the tensors are 4-D ``[1, heads, len, D]``: with 3-D ones SDPA on CPU falls back
    to its unfused path, ten times slower."""
    q_len = q.shape[0]
    if seq.blocks is None:
        keys, values = k, v
    else:
        # [2, nb, bs * kvh * D] -> [2, seq_len, kvh, D]
        kv = _gather_blocks(kv_cache, seq.blocks)
        kv = kv.view(2, -1, *kv_cache.shape[3:])[:, : seq.seq_len]
        keys, values = kv[0], kv[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(q_len, -1)
