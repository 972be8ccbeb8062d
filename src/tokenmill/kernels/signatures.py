"""The signatures of the compiled ops (their schemas in the ``.cpp`` files), as types.

A caller binds an op once, where it is built, and calls it directly in the hot loop: one
linear layer runs about 120 times per decode step, so no Python layer sits between the
caller and the op. Every op computes in float32 inside and rounds once to its output's
dtype; each checks its arguments and raises ``RuntimeError`` naming the one that is wrong.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class RmsNorm(Protocol):
    def __call__(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight`` over each row of ``x [T, H]`` (rows may be
        strided)."""
        ...


class SiluAndMul(Protocol):
    def __call__(self, x: Tensor) -> Tensor:
        """``silu(gate) * up`` for ``x = [gate | up]``, ``[T, 2 * I] -> [T, I]``."""
        ...


class RotaryStoreKV(Protocol):
    def __call__(self, qkv: Tensor, cos: Tensor, sin: Tensor, key_cache: Tensor,
                 value_cache: Tensor, slot_mapping: Tensor, num_heads: int,
                 num_kv_heads: int) -> None:
        """Rotate q and k of ``qkv [T, (heads + 2 kv_heads) D]`` in place by ``cos, sin``
        (``RotaryEmbedding.cos_sin``'s), then write k and v of token ``t`` into the caches
        ``[blocks, block_size, kv_heads, D]`` at flat slot ``slot_mapping[t]`` (int64);
        into 8-bit caches ``[blocks, block_size, kv_heads, D + 4]`` quantized
        (``kv_int8``)."""
        ...


class PagedDecodeAttention(Protocol):
    def __call__(self, q: Tensor, key_cache: Tensor, value_cache: Tensor,
                 block_tables: Tensor, seq_lens: Tensor, scale: float,
                 window: int = 0) -> Tensor:
        """Attention of one query token per sequence, ``q [B, heads, D]`` (rows may be
        strided), over its ``seq_lens[b]`` keys and values read in place in the blocks
        ``block_tables[b]`` names (both int32) -> ``[B, heads, D]``; with ``window > 0``
        over its last ``window`` keys only. The caches are in q's dtype, or both 8-bit
        (``kv_int8``)."""
        ...


class DequantizeKVBlocks(Protocol):
    def __call__(self, cache: Tensor, blocks: Tensor, dtype: torch.dtype) -> Tensor:
        """The blocks ``blocks [n]`` (int64) of an 8-bit layer cache ``[2, num_blocks,
        block_size, kv_heads, D + 4]`` as values ``[2, n, block_size, kv_heads, D]`` in
        ``dtype``: ``kv_int8.dequantize_rows``'s."""
        ...


class PagedPrefillAttention(Protocol):
    def __call__(self, q: Tensor, key_cache: Tensor, value_cache: Tensor,
                 block_tables: Tensor, query_ranges: Tensor, seq_lens: Tensor, scale: float,
                 out: Tensor) -> None:
        """Causal attention of each sequence's new tokens, the flat rows ``query_ranges[b]``
        (``[start, end)``) of ``q [T, heads, D]``, over its ``seq_lens[b]`` keys and values
        in place in its blocks (all int32), written into the same rows of ``out [T, heads
        * D]``. bfloat16 only."""
        ...


class ArgmaxRows(Protocol):
    def __call__(self, x: Tensor) -> Tensor:
        """The first index of each row's largest value (NaN above all), as
        ``x.float().argmax(-1)`` answers, for float32, bfloat16 or float16 rows."""
        ...


class SampleRows(Protocol):
    def __call__(self, logits: Tensor, temperature: Tensor, u: Tensor) -> Tensor:
        """Per row, the first token whose cumulative ``softmax(logits / temperature)``
        passes ``u`` (in [0, 1)) times the total; one pass over the row in its own dtype."""
        ...


class LogprobRows(Protocol):
    def __call__(self, logits: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor,
                                                                            Tensor]:
        """Per row of ``logits [R, V]``, ``log_softmax``'s float32 value at ``token_ids [R]``
        (int64) and at the ``k`` largest logits (largest first, equal ones to the lower id),
        their ids, and the token's rank, 1 + the number of larger logits:
        ``(logprobs [R, 1 + k], top_ids [R, k], ranks [R])``, column 0 of ``logprobs`` the
        token's. One pass over each row in its own dtype."""
        ...


class PackWeight(Protocol):
    def __call__(self, weight: Tensor) -> Tensor:
        """A ``[out, in]`` weight in its linear kernel's panel layout."""
        ...


class FloatLinear(Protocol):
    def __call__(self, x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None,
                 residual: Tensor | None) -> Tensor:
        """``x @ W.T + bias + residual`` over ``packed``, a ``PackWeight``'s ``W``."""
        ...


class Int8Linear(Protocol):
    def __call__(self, x: Tensor, packed: Tensor, scales: Tensor, out_features: int,
                 bias: Tensor | None, residual: Tensor | None) -> Tensor:
        """``FloatLinear`` over int8 weights times one float32 scale per output row."""
        ...


class Int8GroupLinear(Protocol):
    def __call__(self, x: Tensor, packed: Tensor, scales: Tensor, out_features: int,
                 bias: Tensor | None, residual: Tensor | None) -> Tensor:
        """``FloatLinear`` over int8 weights times one float32 scale per 16 or 32 inputs of a
        row, the group size ``K / scales.shape[1]`` (``native_weights.NativeInt8GroupWeight``'s
        layout)."""
        ...


class Int4Linear(Protocol):
    def __call__(self, x: Tensor, packed: Tensor, scales: Tensor, mins: Tensor,
                 out_features: int, bias: Tensor | None, residual: Tensor | None) -> Tensor:
        """``FloatLinear`` over 4-bit weights, ``q * scale + min`` per 32 inputs of a row
        (``native_weights.NativeInt4Weight``'s layout)."""
        ...


class W4A8Linear(Protocol):
    def __call__(self, x: Tensor, packed: Tensor, group_params: Tensor, out_features: int,
                 bias: Tensor | None, residual: Tensor | None) -> Tensor:
        """``FloatLinear`` over 4-bit weights with ``x`` quantized to int8 per group of 32
        inputs (the weights' groups, whose values are centred on 8 against the rounding):
        ``native_weights.NativeW4A8Weight``'s layout (float32 ``x``) or
        ``native_weights.NativeVnniW4A8Weight``'s (bfloat16 or float32)."""
        ...


class W8A8Linear(Protocol):
    def __call__(self, x: Tensor, packed: Tensor, scales: Tensor, out_features: int,
                 bias: Tensor | None, residual: Tensor | None) -> Tensor:
        """``FloatLinear`` over int8 weights times one float32 scale per output row
        (``native_weights.NativeW8A8Weight``'s layout), with ``x`` quantized to int8 per block of
        64 inputs (32 where ``K`` is not a multiple of 64)."""
        ...


class GGUFBlocksLinear(Protocol):
    def __call__(self, x: Tensor, packed: Tensor, params: Tensor, out_features: int,
                 bias: Tensor | None, residual: Tensor | None) -> Tensor:
        """``FloatLinear`` over a GGUF file's own blocks of one type (Q4_K, Q8_0, Q6_K:
        ``native_weights.NativeVnniQ4KWeight``'s, ``NativeVnniQ8_0Weight``'s,
        ``NativeVnniQ6KWeight``'s layouts, ``params`` their block parameters as bytes), with
        ``x`` quantized to int8 per block of the weights' groups (32; Q6_K: 16) and
        multiplied as integers."""
        ...


class VnniDequantize(Protocol):
    def __call__(self, kind: str, packed: Tensor, params: Tensor, out_features: int,
                 in_features: int) -> Tensor:
        """The dense ``[out_features, in_features]`` bfloat16 weight a packed weight of
        ``kind`` holds (``"q4_k"``, ``"q6_k"``, ``"q8_0"``: ``GGUFBlocksLinear``'s layouts;
        ``"w4a8"``: ``native_weights.NativeVnniW4A8Weight``'s): each value the kind's own
        float32 value (a GGUF file's dequantization, bit for bit) rounded once to
        bfloat16."""
        ...


class DecodeLayers(Protocol):
    """A Llama decoder stack bound layer by layer (``decode_layers.cpp``): one call runs a
    step's rows through every layer with the kernels, and the arguments, the layer modules
    call one by one, so its outputs equal theirs bit for bit."""

    def add_layer(self, input_norm: Tensor, post_norm: Tensor, gate_after: bool) -> None:
        """The next layer's two RMSNorm weights; ``gate_after``: ``silu_and_mul`` follows
        its gate/up projection (whose kernel does not gate). Its four projections follow."""
        ...

    def add_linear(self, op_name: str, weight_args: list, trailing_args: list) -> None:
        """The current layer's next projection (qkv, o, gate/up, down): its op's qualified
        name and its arguments but ``x`` and the residual (``native_weights.KernelCall``)."""
        ...

    def add_linear_part(self, op_name: str, weight_args: list, trailing_args: list) -> None:
        """The next part of the projection added last, a weight packed in parts over runs
        of its output rows (``formats.StackedRowsWeight``): its outputs follow the earlier
        parts', and the residual is added to them all."""
        ...

    def run(self, h: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[Tensor],
            slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor,
            one_per_sequence: bool) -> Tensor:
        """The hidden states ``h [T, H]`` of a batch of decode rows after every layer,
        writing each layer's keys and values into ``kv_caches``; ``one_per_sequence``: one
        row a sequence (the rows may then split between threads by sequence)."""
        ...

    def run_mixed(self, h: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[Tensor],
                  slot_mapping: Tensor, decode_rows: Tensor | None,
                  decode_tables: Tensor | None, decode_lens: Tensor | None,
                  prefill_tables: Tensor, query_ranges: Tensor, prefill_lens: Tensor,
                  blocks: Tensor, renumbered: Tensor) -> Tensor:
        """``run`` for a batch with prompt rows, which take the prefill attention
        (``NativePrefillPlan``'s arguments); the decode rows, where any, theirs."""
        ...

    def handover_count(self) -> int:
        """How many times a thread has handed half of its rows to one done early."""
        ...
