"""Paged attention by the engine's native kernels, over the blocks in place (see
``attention``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels import NativeKernels
from tokenmill.models.attention.backend import AttentionBackend, AttentionPlan, PrefillAttention
from tokenmill.models.attention.metadata import AttentionMetadata
from tokenmill.models.attention.sdpa import SdpaPrefill


@dataclass(frozen=True, slots=True)
class NativeDecodePlan:
    block_tables: torch.Tensor  # [Bd, nb] int32
    seq_lens: torch.Tensor  # [Bd] int32


@dataclass(frozen=True, slots=True)
class NativePrefillPlan:
    block_tables: torch.Tensor  # [Bp, nb] int32
    query_ranges: torch.Tensor  # [Bp, 2] int32, flat [start, end)
    seq_lens: torch.Tensor  # [Bp] int32
    # for an 8-bit cache: the blocks the tables name, ascending, and the tables renumbered
    # into them (block_tables[i, j] == blocks[renumbered[i, j]])
    blocks: torch.Tensor  # [n] int64
    renumbered: torch.Tensor  # [Bp, nb] int32


class NativeDecode:
    """Every decode sequence in one ``paged_decode_attention`` call, each over its own
    length (with a ``window``: over its last ``window`` keys, read from their blocks
    only)."""

    def __init__(self, kernels: NativeKernels, window: int | None = None) -> None:
        self._attention = kernels.paged_decode_attention
        self.window = window or 0  # the kernel's: 0 is none

    def plan(self, block_tables: torch.Tensor, seq_lens: list[int],
             num_cache_blocks: int) -> NativeDecodePlan:
        return NativeDecodePlan(block_tables.to(torch.int32),
                                torch.tensor(seq_lens, dtype=torch.int32,
                                             device=block_tables.device))

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: NativeDecodePlan,
                 scale: float) -> torch.Tensor:
        out = self._attention(q, kv_cache[0], kv_cache[1], plan.block_tables, plan.seq_lens,
                              scale, self.window)
        return out.view(q.shape[0], -1)


class NativePrefill:
    """Every prefill sequence in one ``paged_prefill_attention`` call; from an 8-bit cache,
    over a copy of the sequences' blocks dequantized to the model's dtype (the kernel reads
    bfloat16 rows)."""

    reads_new_kv = False  # the kernel reads them from the cache
    row_invariant = True  # each query's keys in tiles from key 0, its values in key order

    def __init__(self, kernels: NativeKernels, dtype: torch.dtype, head_dim: int) -> None:
        self._attention = kernels.prefill_attention(dtype, head_dim)
        self._dequantize_blocks = kernels.dequantize_kv_blocks

    def plan(self, md: AttentionMetadata, rows: list[int],
             num_cache_blocks: int) -> NativePrefillPlan:
        device = md.slot_mapping.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        spans = [md.prefill_span(i) for i in rows]
        nb = -(-max(seq_len for _, _, seq_len in spans) // md.block_size)
        tables = md.block_tables[index, :nb]
        blocks, renumbered = torch.unique(tables, return_inverse=True)
        return NativePrefillPlan(
            block_tables=tables.to(torch.int32), blocks=blocks,
            renumbered=renumbered.to(torch.int32),
            query_ranges=torch.tensor([(start, end) for start, end, _ in spans],
                                      dtype=torch.int32, device=device),
            seq_lens=torch.tensor([seq_len for _, _, seq_len in spans], dtype=torch.int32,
                                  device=device),
        )

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 kv_cache: torch.Tensor, plan: NativePrefillPlan, scale: float,
                 out: torch.Tensor) -> None:
        tables = plan.block_tables
        if kv_cache.dtype == torch.int8:
            kv_cache = self._dequantize_blocks(kv_cache, plan.blocks, q.dtype)
            tables = plan.renumbered
        self._attention(q, kv_cache[0], kv_cache[1], tables, plan.query_ranges,
                        plan.seq_lens, scale, out)


class NativeAttention(AttentionBackend):
    """Rotary and the KV store in one pass (``rotary_store_kv``), then ``NativeDecode``,
    and ``NativePrefill`` where ``kernels.capabilities`` has it for ``dtype`` (the model's)
    and ``head_dim`` and the CPU has no AMX, else ``SdpaPrefill``; ``scale``: of q . k
    (None: ``head_dim ** -0.5``). With AMX, PyTorch's SDPA multiplies with AMX tiles and
    prefills faster than the native kernel's VDPBF16PS at every prompt size measured (2.1x
    for a 2048-token prompt, 1.06x for sixteen of 128 tokens). With a sliding ``window``,
    the decode kernel takes it and prefills take ``SdpaPrefill`` with it (the prefill
    kernel has no window)."""

    def __init__(self, kernels: NativeKernels, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, scale: float | None = None,
                 window: int | None = None) -> None:
        native_prefill = (window is None and not kernels.capabilities.amx
                          and kernels.capabilities.prefill_attention(dtype, head_dim))
        prefill: PrefillAttention = (NativePrefill(kernels, dtype, head_dim) if native_prefill
                                     else SdpaPrefill(dtype, window))
        super().__init__(num_heads, num_kv_heads, head_dim, NativeDecode(kernels, window),
                         prefill, scale)
        self._rotary_store_kv = kernels.rotary_store_kv

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        self._rotary_store_kv(qkv, cos, sin, kv_cache[0], kv_cache[1], plan.slot_mapping,
                              self.num_heads, self.num_kv_heads)
        q = qkv[:, : self.q_size].view(num_tokens, -1, self.head_dim)
        if plan.prefill is None:  # every token is a decode
            return self.decode(q, kv_cache, plan.decode, self.scale)
        k = v = None  # read from the cache, except by a prefill attention that reads them
        if self.prefill.reads_new_kv:
            k, v = (qkv[:, lo:hi].view(num_tokens, -1, self.head_dim)
                    for lo, hi in ((self.q_size, self.qk_size), (self.qk_size, qkv.shape[1])))
        return self._attend_with_prefills(q, k, v, kv_cache, plan)
