"""The 8-bit KV cache (``kv_int8``): rows written by the native store as PyTorch's
``quantize_rows`` writes them, read by every attention path as the values they stand for,
and what it costs the embedded model in accuracy."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import (
    BLOCK_SIZE,
    CASES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    PREFILL_CASES,
    make_batch,
    naive_attention,
    store_and_attend,
    without_amx,
)
from test_weight_formats import TEXT

from tokenmill.models.attention.kv_int8 import dequantize_rows, quantize_rows, row_width
from tokenmill.models.attention.native import NativeAttention, NativePrefillPlan
from tokenmill.models.attention.sdpa import SdpaAttention
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.loader import load_model
from tokenmill.models.perplexity import mean_kl_divergence, next_token_logprobs, perplexity_of
from tokenmill.models.weights.quantizations import resolve_dtype
from tokenmill.tokenizer.tokenizer import load_tokenizer

CPU = torch.device("cpu")


def test_rows_hold_each_value_within_half_a_step_of_its_scale():
    x = torch.randn(5, 3, 64) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x[4, 1] = 0  # a row of zeros: scale 0, values 0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, row_width(64, True)) == (5, 3, 68)
    scales = rows[..., 64:].contiguous().view(torch.float32)
    torch.testing.assert_close(scales[..., 0], x.abs().amax(-1) / 127)
    back = dequantize_rows(rows, torch.float32)
    assert (back - x).abs().le(scales * 0.5 * (1 + 1e-5)).all()
    assert rows[..., :64].abs().amax(-1)[x.abs().amax(-1) > 0].eq(127).all()
    assert not back[4, 1].any() and scales[4, 1] == 0
    assert dequantize_rows(rows, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_kv_writes_the_rows_quantize_rows_writes(native, dtype):
    tokens, num_blocks, block_size, heads, kv_heads, head_dim = 21, 16, 4, 9, 3, 64
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None, dtype, CPU)
    cos, sin = rope.cos_sin(torch.randint(0, 256, (tokens,)))
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 3).to(dtype)
    qkv[3, heads * head_dim:(heads + 1) * head_dim] = 0  # a key row of zeros
    keys = torch.zeros(num_blocks, block_size, kv_heads, head_dim + 4, dtype=torch.int8)
    values = torch.zeros_like(keys)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    rotated = qkv.clone()
    native.rotary_store_kv(rotated, cos[:, 0], sin[:, 0], keys, values, slots, heads, kv_heads)

    k, v = (rotated[:, lo:hi].view(tokens, kv_heads, head_dim)
            for lo, hi in (((heads) * head_dim, (heads + kv_heads) * head_dim),
                           ((heads + kv_heads) * head_dim, None)))
    assert torch.equal(keys.view(-1, kv_heads, head_dim + 4)[slots], quantize_rows(k))
    assert torch.equal(values.view(-1, kv_heads, head_dim + 4)[slots], quantize_rows(v))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not keys.view(num_blocks * block_size, -1)[untouched].any()


# the head sizes and query heads a KV head of test_native_decode_kernel_for_each_head_size;
# 40 sequences: a task each
@pytest.mark.parametrize("head_dim", [64, 128, 256, 40])
@pytest.mark.parametrize(("heads", "kv_heads", "num_seqs"),
                         [(HEADS, KV_HEADS, 4), (16, 2, 4), (HEADS, KV_HEADS, 40)])
@pytest.mark.parametrize("window", [0, 9])
def test_native_decode_kernel_reads_an_8_bit_cache_as_its_values(head_dim, heads, kv_heads,
                                                                 num_seqs, window, native):
    """The kernel over the 8-bit rows == the kernel over their values (float32): to
    rounding for float32 queries, within the output's rounding for bfloat16 ones; where the
    kernel scores the keys as integers, with the queries rounded to 8-bit rows as it
    rounds them."""
    gen = torch.Generator().manual_seed(head_dim + window)
    max_blocks = 13
    lens = torch.tensor([[1, 17, 40, 5][b % 4] + b // 4 for b in range(num_seqs)],
                        dtype=torch.int32)
    num_blocks = num_seqs * max_blocks + 8
    rows = quantize_rows(torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim,
                                     generator=gen) * 5)
    values = dequantize_rows(rows, torch.float32)
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * max_blocks]
    tables = tables.view(num_seqs, max_blocks).to(torch.int32)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen)
    op = native.paged_decode_attention

    def as_scored(q):  # the queries as the kernel multiplies them, in float32
        if native.capabilities.int8_kv_integer_scores(q.dtype, head_dim):
            return dequantize_rows(quantize_rows(q), torch.float32)
        return q.float()

    expected = op(as_scored(q), values[0], values[1], tables, lens, head_dim**-0.5, window)
    torch.testing.assert_close(op(q, rows[0], rows[1], tables, lens, head_dim**-0.5, window),
                               expected, atol=1e-4, rtol=1e-4)
    q = q.bfloat16()
    out = op(q, rows[0], rows[1], tables, lens, head_dim**-0.5, window)
    expected = op(as_scored(q), values[0], values[1], tables, lens, head_dim**-0.5, window)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_native_decode_kernel_rejects_a_mismatched_8_bit_cache(native):
    op = native.paged_decode_attention
    q = torch.zeros(1, HEADS, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    narrow = torch.zeros(2, 4, BLOCK_SIZE, KV_HEADS, 64, dtype=torch.int8)  # no scales
    with pytest.raises(RuntimeError, match="D \\+ 4 if int8"):
        op(q, narrow[0], narrow[1], tables, lens, 1.0)
    rows = torch.zeros(2, 4, BLOCK_SIZE, KV_HEADS, 68, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="both be int8"):
        op(q, rows[0], rows[1].float(), tables, lens, 1.0)


def quantized_batch(case_lens, seed, head_dim, dtype):
    """``make_batch`` with its cache in 8-bit rows, and each sequence's keys and values
    (earlier and new) as that cache gives them back: what attention must see."""
    seq_lens, query_lens = case_lens
    cache, md, full_kv, qs = make_batch(seq_lens, query_lens, seed=seed, head_dim=head_dim)
    cache = quantize_rows(cache)
    seen = [tuple(dequantize_rows(quantize_rows(x.to(dtype)), torch.float32) for x in kv)
            for kv in full_kv]
    new = [tuple(x[s - n:].to(dtype) for x in kv)
           for kv, s, n in zip(full_kv, seq_lens, query_lens, strict=True)]
    return cache, md, seen, new, [q.to(dtype) for q in qs]


@pytest.mark.parametrize("backend", ["sdpa", "native"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_over_an_8_bit_cache_equals_naive_over_its_values(case, backend,
                                                                          request):
    """float32: each backend stores the new keys and values as 8-bit rows and attends,
    decodes and prefills (a fresh prompt too), over the values the rows stand for."""
    seq_lens, query_lens = CASES[case]
    cache, md, seen, new, qs = quantized_batch(CASES[case], len(case), HEAD_DIM, torch.float32)
    attention = (NativeAttention(request.getfixturevalue("native"), HEADS, KV_HEADS, HEAD_DIM,
                                 torch.float32)
                 if backend == "native" else SdpaAttention(HEADS, KV_HEADS, HEAD_DIM,
                                                           torch.float32))
    k, v = (torch.cat([kv[i] for kv in new]) for i in (0, 1))
    out = store_and_attend(attention, torch.cat(qs), k, v, cache,
                           attention.plan(md, cache.shape[1]))
    expected = torch.cat([naive_attention(qi, ki, vi, s - n)
                          for qi, (ki, vi), s, n in zip(qs, seen, seq_lens, query_lens,
                                                        strict=True)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    flat = cache.view(2, -1, KV_HEADS, HEAD_DIM + 4)
    assert torch.equal(flat[0, md.slot_mapping], quantize_rows(k))
    assert torch.equal(flat[1, md.slot_mapping], quantize_rows(v))


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_native_prefill_kernel_reads_an_8_bit_cache_as_its_values(case, native):
    """bfloat16: the prefill kernel over a copy of the sequences' blocks dequantized to
    bfloat16 (one rounding more than the decode kernel's float32 values: hence 2e-2)."""
    if not native.capabilities.prefill_attention(torch.bfloat16, 64):
        pytest.skip("this CPU has no AVX512-BF16: prefills take SDPA")
    seq_lens, query_lens = PREFILL_CASES[case]
    cache, md, seen, new, qs = quantized_batch(PREFILL_CASES[case], 7, 64, torch.bfloat16)
    attention = NativeAttention(without_amx(native), HEADS, KV_HEADS, 64, torch.bfloat16)
    plan = attention.plan(md, cache.shape[1])
    assert isinstance(plan.prefill, NativePrefillPlan)
    k, v = (torch.cat([kv[i] for kv in new]) for i in (0, 1))
    out = store_and_attend(attention, torch.cat(qs), k, v, cache, plan)
    expected = torch.cat([naive_attention(qi, ki, vi, s - n)
                          for qi, (ki, vi), s, n in zip(qs, seen, seq_lens, query_lens,
                                                        strict=True)])
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_an_8_bit_cache_costs_smollm2_under_two_percent_of_perplexity(native):
    """The embedded model in the dtype the engine picks, on the fixed text, its keys and
    values read from either cache: perplexity within 2%, predictions close (KL, top-1);
    through the prefill attention (the whole text in one prefill) and through the decode
    attention (its first 600 tokens one decode step each)."""
    with open(TEXT, encoding="utf-8") as f:
        token_ids = load_tokenizer(None).encode(f.read())
    model = load_model(None, resolve_dtype("auto", CPU, "none"), CPU, "none", native)[0]
    for text, decode_from in ((token_ids, None), (token_ids[:600], 32)):
        exact = next_token_logprobs(model, text, decode_from=decode_from)
        quantized = next_token_logprobs(model, text, kv_int8=True, decode_from=decode_from)
        assert perplexity_of(quantized, text) <= perplexity_of(exact, text) * 1.02
        assert mean_kl_divergence(exact, quantized) < 0.03
        assert (exact.argmax(-1) == quantized.argmax(-1)).float().mean() > 0.9
