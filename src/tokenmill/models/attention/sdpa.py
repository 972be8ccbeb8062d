"""Paged attention by PyTorch's ops: SDPA over gathered blocks (see ``attention``).

An 8-bit cache (``kv_int8``) is read as the native kernels read it: its gathered rows
are dequantized, and a prompt with no earlier context attends over its new keys and
values as the cache holds them (quantized and back), not as computed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.models.attention.backend import AttentionBackend, AttentionPlan
from tokenmill.models.attention.kv_int8 import dequantize_rows, quantize_rows
from tokenmill.models.attention.metadata import AttentionMetadata
from tokenmill.models.layers.rotary import apply_rotary


@dataclass(frozen=True, slots=True)
class SdpaDecodePlan:
    # [2 * Bd * nb]: the keys' blocks row-major, then the values' (see ``_gather_blocks``)
    block_ids: torch.Tensor
    num_seqs: int  # Bd
    max_len: int  # L, the longest context
    mask: torch.Tensor | None  # [Bd, 1, 1, L] additive; None: all contexts are L long


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    start: int  # flat token range [start, end) of this sequence's new tokens
    end: int
    num_keys: int  # keys read from the cache: the first ones of ``blocks``
    # [2 * blocks from first_key's to the last] as _kv_rows; None when ctx == 0 (the new
    # keys are read from k, v)
    blocks: torch.Tensor | None
    # [q_len, num_keys] additive (0 or -inf); None: plain causal (ctx == 0, no window cut)
    mask: torch.Tensor | None


class SdpaDecode:
    """Every decode sequence in one padded SDPA call, GQA as query rows of a KV head."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the masks' (additive: 0 where visible, -inf elsewhere)

    def plan(self, block_tables: torch.Tensor, seq_lens: list[int], num_cache_blocks: int,
             first_keys: list[int] | None = None) -> SdpaDecodePlan:
        """As ``DecodeAttention.plan``; ``first_keys[b]`` (a sliding window's): row ``b``
        sees its keys ``first_keys[b] .. seq_lens[b] - 1`` only (None: from 0)."""
        max_len = max(seq_lens)
        mask = None
        cut = first_keys is not None and max(first_keys) > 0
        if min(seq_lens) != max_len or cut:
            device = block_tables.device
            lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
            keys = torch.arange(max_len, device=device)
            visible = keys[None, :] < lens[:, None]
            if cut:
                firsts = torch.tensor(first_keys, dtype=torch.long, device=device)
                visible &= keys[None, :] >= firsts[:, None]
            mask = _additive(visible.view(len(seq_lens), 1, 1, max_len), self.dtype)
        return SdpaDecodePlan(_kv_rows(block_tables.reshape(-1), num_cache_blocks),
                              len(seq_lens), max_len, mask)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: SdpaDecodePlan,
                 scale: float) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        q, k, v = decode_operands(q, kv_cache, plan)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale)
        return out.reshape(num_seqs, num_heads * head_dim)


def decode_operands(q: torch.Tensor, kv_cache: torch.Tensor, plan: SdpaDecodePlan
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [Bd, heads, D]`` as ``[Bd, kvh, G, D]`` (the G query heads of each KV head) and
    the gathered keys and values, ``[Bd, kvh, L, D]`` each (``plan.mask`` hides padding)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    # [2, Bd * nb, bs * kvh * D] -> [2, Bd, nb * bs, kvh, D] -> k, v as [Bd, kvh, L, D]
    kv = _gather_blocks(kv_cache, plan.block_ids)
    kv = _cache_values(kv.view(2, num_seqs, -1, *kv_cache.shape[3:])[:, :, : plan.max_len],
                       q.dtype)
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    return q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim), k, v


class SdpaPrefill:
    """One causal SDPA call per prefill sequence; with a ``window``, over the keys each
    query's window holds (see ``attention``)."""

    reads_new_kv = True  # a sequence with no earlier context attends over them directly
    row_invariant = False  # PyTorch's kernels choose their blocking by the chunk's size

    def __init__(self, dtype: torch.dtype, window: int | None = None) -> None:
        self.dtype = dtype  # the masks'
        self.window = window

    def plan(self, md: AttentionMetadata, rows: list[int],
             num_cache_blocks: int) -> list[PrefillSeq]:
        return [self._plan_seq(md, i, num_cache_blocks) for i in rows]

    def _plan_seq(self, md: AttentionMetadata, i: int, num_cache_blocks: int) -> PrefillSeq:
        start, end, seq_len = md.prefill_span(i)
        ctx = seq_len - (end - start)
        window = self.window if self.window is not None and seq_len > self.window else None
        if ctx == 0 and window is None:
            return PrefillSeq(start, end, seq_len, None, None)
        device = md.slot_mapping.device
        # the first block read: the one of the first query's first visible key
        first_block = 0 if window is None else max(0, ctx - window + 1) // md.block_size
        first_key = 0 if ctx == 0 else first_block * md.block_size
        blocks = None if ctx == 0 else _kv_rows(
            md.block_tables[i, first_block : -(-seq_len // md.block_size)], num_cache_blocks)
        query_pos = torch.arange(ctx, seq_len, device=device)[:, None]
        key_pos = torch.arange(first_key, seq_len, device=device)[None, :]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        return PrefillSeq(start, end, seq_len - first_key, blocks,
                          _additive(visible, self.dtype))

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 kv_cache: torch.Tensor, plan: list[PrefillSeq], scale: float,
                 out: torch.Tensor) -> None:
        assert k is not None and v is not None, "reads_new_kv"
        for seq in plan:
            out[seq.start : seq.end] = _prefill_attention(
                q[seq.start : seq.end], k[seq.start : seq.end], v[seq.start : seq.end],
                kv_cache, seq, scale,
            )


class SdpaAttention(AttentionBackend[SdpaDecodePlan, list[PrefillSeq]]):
    """Rotary and the KV store as PyTorch ops, then ``SdpaDecode`` and ``SdpaPrefill``;
    ``dtype``: the model's; ``scale``: of q . k (None: ``head_dim ** -0.5``); ``window``:
    a sliding window (see ``attention``; None: none)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, scale: float | None = None,
                 window: int | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, SdpaDecode(dtype),
                         SdpaPrefill(dtype, window), scale)
        self.window = window

    def _plan_decode(self, block_tables: torch.Tensor, seq_lens: list[int], block_size: int,
                     num_cache_blocks: int) -> SdpaDecodePlan:
        """Each row's table shifted to start at the block of its first visible key
        ``max(0, len - window)``; the keys before it in that block are masked."""
        if self.window is None or max(seq_lens) <= self.window:
            return self.decode.plan(block_tables, seq_lens, num_cache_blocks)
        firsts = [max(0, n - self.window) // block_size for n in seq_lens]
        lens = [n - f * block_size for n, f in zip(seq_lens, firsts, strict=True)]
        first_keys = [max(0, n - self.window) - f * block_size
                      for n, f in zip(seq_lens, firsts, strict=True)]
        width = -(-max(lens) // block_size)
        device = block_tables.device
        cols = (torch.tensor(firsts, dtype=torch.long, device=device)[:, None]
                + torch.arange(width, device=device)).clamp_(max=block_tables.shape[1] - 1)
        return self.decode.plan(block_tables.gather(1, cols), lens, num_cache_blocks,
                                first_keys)

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor,
                 plan: AttentionPlan[SdpaDecodePlan, list[PrefillSeq]]) -> torch.Tensor:
        q, k, v = self.rotate_and_store(qkv, cos, sin, kv_cache, plan)
        if plan.prefill is None:  # every token is a decode
            return self.decode(q, kv_cache, plan.decode, self.scale)
        return self._attend_with_prefills(q, k, v, kv_cache, plan)


    def rotate_and_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         kv_cache: torch.Tensor, plan: AttentionPlan
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, heads, D]``, ``k, v [T, kv_heads, D]`` of ``qkv``, q and k rotated, the
        new k and v written into ``kv_cache`` at ``plan.slot_mapping``."""
        num_tokens = qkv.shape[0]
        # q and k rotated together: [T, heads + kv_heads, D]
        qk = apply_rotary(qkv[:, : self.qk_size].view(num_tokens, -1, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        for cache, new in ((kv_cache[0], k), (kv_cache[1], v)):
            rows = quantize_rows(new) if cache.dtype == torch.int8 else new
            cache.view(-1, *rows.shape[1:]).index_copy_(0, plan.slot_mapping, rows)
        return q, k, v


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


def _cache_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as keys or values in ``dtype``: the rows themselves, or an 8-bit
    cache's dequantized."""
    return dequantize_rows(rows, dtype) if rows.dtype == torch.int8 else rows


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
) -> torch.Tensor:
    """Causal (windowed: by ``seq.mask``) attention for one sequence's ``q_len`` new
    tokens -> ``[q_len, heads*D]``.

    NOTE: the tensors are 4-D ``[1, heads, len, D]``: with 3-D ones SDPA on CPU falls back
    to its unfused path, ten times slower."""
    keys, values = prefill_keys_values(k, v, kv_cache, seq, q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def prefill_keys_values(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        seq: PrefillSeq, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``[seq.num_keys, kv_heads, D]`` one prefill sequence attends
    over: its new ``k, v`` (as an 8-bit cache holds them) where it has no earlier context,
    else gathered from the cache."""
    if seq.blocks is None and kv_cache.dtype == torch.int8:
        return tuple(dequantize_rows(quantize_rows(x), dtype) for x in (k, v))
    if seq.blocks is None:
        return k, v
    # [2, nb, bs * kvh * D] -> [2, seq_len, kvh, D]
    kv = _gather_blocks(kv_cache, seq.blocks)
    kv = _cache_values(kv.view(2, -1, *kv_cache.shape[3:])[:, : seq.num_keys], dtype)
    return kv[0], kv[1]
