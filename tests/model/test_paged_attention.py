"""Paged attention == naive full causal attention, on random tensors (GQA, ragged batch), by
each backend; the native kernels against SDPA and exact arithmetic."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from tokenmill.models.attention.metadata import AttentionMetadata
from tokenmill.models.attention.native import (
    NativeAttention,
    NativeDecode,
    NativeDecodePlan,
    NativePrefillPlan,
)
from tokenmill.models.attention.sdpa import SdpaAttention, SdpaDecode

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 64


def naive_attention(q, k, v, ctx):
    """q [n, H, D] at positions ctx..ctx+n-1; k, v [ctx+n, KVH, D]: explicit softmax, float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(ctx, ctx + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def store_and_attend(backend, q, k, v, cache, plan):
    """The backend's layer call on the new ``q, k, v`` as they are: their ``qkv`` with a
    rotation by angle 0 (cos 1, sin 0: exact in every dtype)."""
    num_tokens = q.shape[0]
    qkv = torch.cat([t.reshape(num_tokens, -1) for t in (q, k, v)], dim=1)
    cos = torch.ones(num_tokens, 1, q.shape[-1], dtype=q.dtype)
    return backend(qkv, cos, torch.zeros_like(cos), cache, plan)


def make_batch(seq_lens, query_lens, seed, head_dim=HEAD_DIM, num_blocks=NUM_BLOCKS):
    """Random K/V histories written into shuffled blocks; returns what one step needs."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, head_dim, generator=gen) * 100
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables, slots, full_kv, qs = [], [], [], []
    for seq_len, q_len in zip(seq_lens, query_lens, strict=True):
        table = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        k, v = (torch.randn(seq_len, KV_HEADS, head_dim, generator=gen) for _ in range(2))
        seq_slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
        ctx = seq_len - q_len
        flat = cache.view(2, -1, KV_HEADS, head_dim)
        flat[0, seq_slots[:ctx]], flat[1, seq_slots[:ctx]] = k[:ctx], v[:ctx]
        tables.append(table)
        slots += seq_slots[ctx:]
        full_kv.append((k, v))
        qs.append(torch.randn(q_len, HEADS, head_dim, generator=gen))
    width = max(len(t) for t in tables)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=starts,
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        block_size=BLOCK_SIZE,
    )
    return cache, md, full_kv, qs


CASES = {
    "decode_equal_lengths": ([9, 9, 9], [1, 1, 1]),
    "decode_ragged": ([1, 13, 6, 30, 4], [1, 1, 1, 1, 1]),
    "prefill_fresh": ([7, 12], [7, 12]),
    "prefill_chunk_after_context": ([20, 11], [6, 3]),
    "mixed": ([25, 1, 9, 17, 3, 8], [1, 1, 9, 5, 1, 2]),
}


@pytest.mark.parametrize("backend", ["sdpa", "native"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_equals_naive(case, backend, request):
    """float32: SDPA throughout, or the native decode kernel with SDPA prefills."""
    seq_lens, query_lens = CASES[case]
    cache, md, full_kv, qs = make_batch(seq_lens, query_lens, seed=len(case))
    q = torch.cat(qs)
    k = torch.cat([k[s - n :] for (k, _), s, n in zip(full_kv, seq_lens, query_lens, strict=True)])
    v = torch.cat([v[s - n :] for (_, v), s, n in zip(full_kv, seq_lens, query_lens, strict=True)])
    attention = (NativeAttention(request.getfixturevalue("native"), HEADS, KV_HEADS, HEAD_DIM,
                                 torch.float32)
                 if backend == "native" else SdpaAttention(HEADS, KV_HEADS, HEAD_DIM,
                                                           torch.float32))
    out = store_and_attend(attention, q, k, v, cache, attention.plan(md, cache.shape[1]))

    expected = torch.cat([
        naive_attention(qi, ki, vi, s - n)
        for qi, (ki, vi), s, n in zip(qs, full_kv, seq_lens, query_lens, strict=True)
    ])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    flat = cache.view(2, -1, KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat[0, md.slot_mapping], k)  # new keys/values were stored
    torch.testing.assert_close(flat[1, md.slot_mapping], v)


def test_plan_takes_the_batched_decode_path():
    """A pure-decode batch is planned as one padded call, masked only when lengths differ."""
    attention = SdpaAttention(HEADS, KV_HEADS, HEAD_DIM, torch.float32)
    cache, md, _, _ = make_batch([1, 13, 6], [1, 1, 1], seed=0)
    plan = attention.plan(md, cache.shape[1])
    assert plan.prefill is None and plan.decode_token_idx is None
    assert plan.decode.num_seqs == 3 and plan.decode.max_len == 13
    blocks = md.block_tables[:, :4].reshape(-1).tolist()  # keys' rows, then values'
    assert plan.decode.block_ids.tolist() == blocks + [b + cache.shape[1] for b in blocks]
    assert (plan.decode.mask[:, 0, 0] == 0).sum(-1).tolist() == [1, 13, 6]
    cache, md, _, _ = make_batch([9, 9], [1, 1], seed=0)
    assert attention.plan(md, cache.shape[1]).decode.mask is None


def test_plan_tells_whether_each_decode_row_is_its_sequence_s_only_one():
    """One decode a sequence: its rows are independent; a verification's several decode rows
    of one sequence attend to each other's new keys and values."""
    attention = SdpaAttention(HEADS, KV_HEADS, HEAD_DIM, torch.float32)
    cache, md, _, _ = make_batch([1, 13, 6], [1, 1, 1], seed=0)
    assert attention.plan(md, cache.shape[1]).decodes_one_per_sequence
    cache, md, _, _ = make_batch([13, 6], [3, 1], seed=0)
    verification = dataclasses.replace(md, prefill_lens=[0, 0])
    assert not attention.plan(verification, cache.shape[1]).decodes_one_per_sequence


def without_amx(native):
    """``native`` as a build on a CPU without AMX: ``NativeAttention`` then takes the prefill
    kernel wherever the build has it (with AMX it prefers SDPA's)."""
    return dataclasses.replace(native,
                               capabilities=dataclasses.replace(native.capabilities, amx=False))


def test_plan_of_a_mixed_batch_splits_decodes_from_prefills(native):
    """Each sub-plan holds only its own sequences: the decodes' flat rows and lengths, the
    prefills' query ranges."""
    attention = NativeAttention(without_amx(native), HEADS, KV_HEADS, 64, torch.bfloat16)
    cache, md, _, _ = make_batch([25, 1, 9, 17, 3], [1, 1, 9, 5, 1], seed=0, head_dim=64)
    plan = attention.plan(md, cache.shape[1])
    assert plan.decode_token_idx.tolist() == [0, 1, 16]
    assert isinstance(plan.decode, NativeDecodePlan)
    assert plan.decode.seq_lens.tolist() == [25, 1, 3]
    assert plan.decode.block_tables.dtype == torch.int32
    if native.capabilities.prefill_attention(torch.bfloat16, 64):
        assert isinstance(plan.prefill, NativePrefillPlan)
        assert plan.prefill.query_ranges.tolist() == [[2, 11], [11, 16]]
        assert plan.prefill.seq_lens.tolist() == [9, 17]
    else:
        assert [(seq.start, seq.end) for seq in plan.prefill] == [(2, 11), (11, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_decode_kernel_matches_sdpa_on_strided_queries(dtype, native):
    """The kernel reads q rows in place (a view, as the model's q/k split gives it) and
    agrees with the SDPA path in every storage dtype: float32 to rounding, the 16-bit
    dtypes within their precision (both accumulate in float32)."""
    cache, md, _, _ = make_batch([1, 13, 6, 30, 4, 17], [1] * 6, seed=3)
    cache = cache.to(dtype) / 100
    qk = torch.randn(6, HEADS + KV_HEADS, HEAD_DIM).to(dtype)
    q = qk[:, :HEADS]  # not contiguous
    native_decode, sdpa_decode = NativeDecode(native), SdpaDecode(dtype)
    out = native_decode(q, cache, native_decode.plan(md.block_tables, md.seq_lens, NUM_BLOCKS),
                        HEAD_DIM**-0.5)
    sdpa = sdpa_decode(q.contiguous(), cache,
                       sdpa_decode.plan(md.block_tables, md.seq_lens, NUM_BLOCKS),
                       HEAD_DIM**-0.5)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.reshape(6, -1).float(), sdpa.float(),
                               atol=tolerance, rtol=tolerance)


def test_native_decode_kernel_rejects_bad_input(native):
    op = native.paged_decode_attention
    cache = torch.zeros(2, 4, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    q = torch.zeros(1, HEADS, HEAD_DIM)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        op(q, cache[0], cache[1], tables.long(), lens, 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        op(q.double(), cache[0], cache[1], tables, lens, 1.0)


# unrolled sizes (64, 128 and 256 register-blocked on AVX2) and the generic loop; query
# heads per KV head: 3 (one value pass), 1, 8 (passes of 3, 3 and 2 heads); 4 sequences
# split by KV head over the threads, 40 sequences a task each
@pytest.mark.parametrize("head_dim", [64, 128, 256, 40])
@pytest.mark.parametrize(("heads", "kv_heads", "num_seqs"),
                         [(HEADS, KV_HEADS, 4), (2, 2, 4), (16, 2, 4), (HEADS, KV_HEADS, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_kernel_for_each_head_size(head_dim, heads, kv_heads, num_seqs, dtype,
                                                 native):
    gen = torch.Generator().manual_seed(head_dim)
    max_blocks = 13  # 52 tokens, above the longest (49)
    lens = [[1, 17, 40, 5][b % 4] + b // 4 for b in range(num_seqs)]
    num_blocks = num_seqs * max_blocks + 8
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * max_blocks]
    tables = tables.view(num_seqs, max_blocks)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
    out = native.paged_decode_attention(q, cache[0], cache[1], tables.to(torch.int32),
                                        torch.tensor(lens, dtype=torch.int32), head_dim**-0.5)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for b, seq_len in enumerate(lens):
        rows = torch.tensor([int(tables[b, t // BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE
                             for t in range(seq_len)])
        k, v = (cache[i].reshape(-1, kv_heads, head_dim)[rows] for i in (0, 1))
        group = heads // kv_heads
        scores = torch.einsum("hd,thd->ht", q[b].double(),
                              k.double().repeat_interleave(group, dim=1)) * head_dim**-0.5
        expected = torch.einsum("ht,thd->hd", scores.softmax(-1),
                                v.double().repeat_interleave(group, dim=1))
        torch.testing.assert_close(out[b].double(), expected, atol=tolerance, rtol=tolerance)


# prompts of one tile and of several (16 queries a tile), chunks after context (ctx not a
# multiple of 16), prefills between decodes
PREFILL_CASES = {
    "fresh": ([7, 40], [7, 40]),
    "chunks_after_context": ([53, 30], [20, 3]),
    "mixed_with_decodes": ([25, 1, 37, 17, 3], [1, 1, 37, 5, 1]),
}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_native_prefill_kernel_equals_naive(case, head_dim, native):
    """bfloat16 (the kernel's dtype): within the rounding of bfloat16 inputs and output."""
    if not native.capabilities.prefill_attention(torch.bfloat16, head_dim):
        pytest.skip("this CPU has no AVX512-BF16: prefills take SDPA")
    seq_lens, query_lens = PREFILL_CASES[case]
    cache, md, full_kv, qs = make_batch(seq_lens, query_lens, seed=head_dim, head_dim=head_dim)
    cache = cache.to(torch.bfloat16)  # unused slots hold large values: reading one shows
    full_kv = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in full_kv]
    qs = [q.to(torch.bfloat16) for q in qs]
    q = torch.cat(qs)
    k = torch.cat([k[s - n :] for (k, _), s, n in zip(full_kv, seq_lens, query_lens, strict=True)])
    v = torch.cat([v[s - n :] for (_, v), s, n in zip(full_kv, seq_lens, query_lens, strict=True)])
    attention = NativeAttention(without_amx(native), HEADS, KV_HEADS, head_dim, torch.bfloat16)
    plan = attention.plan(md, cache.shape[1])
    assert isinstance(plan.prefill, NativePrefillPlan)
    out = store_and_attend(attention, q, k, v, cache, plan)

    expected = torch.cat([
        naive_attention(qi, ki, vi, s - n)
        for qi, (ki, vi), s, n in zip(qs, full_kv, seq_lens, query_lens, strict=True)
    ])
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
def test_native_prefill_kernel_rows_do_not_depend_on_the_chunking(heads, kv_heads, native):
    """One 45-token prompt attended at once, and in chunks cut at other places (tiles of
    16 queries then start elsewhere, and a tile's lanes hold other rows): every row is the
    same bits; with 1 to 8 query heads per KV head (up to 8 registers of rows a tile), each
    within bfloat16's rounding of exact attention."""
    if not native.capabilities.prefill_attention(torch.bfloat16, 64):
        pytest.skip("this CPU has no AVX512-BF16: prefills take SDPA")
    op = native.prefill_attention(torch.bfloat16, 64)
    gen = torch.Generator().manual_seed(heads)
    length, block_size = 45, 8
    blocks = torch.randperm(12, generator=gen)[: -(-length // block_size)].to(torch.int32)
    cache = torch.randn(2, 12, block_size, kv_heads, 64, generator=gen).bfloat16()
    q = torch.randn(length, heads, 64, generator=gen).bfloat16()

    def attend(chunks: list[int]) -> torch.Tensor:
        out = torch.zeros(length, heads * 64, dtype=torch.bfloat16)
        start = 0
        for end in chunks:
            op(q, cache[0], cache[1], blocks.view(1, -1),
               torch.tensor([[start, end]], dtype=torch.int32),
               torch.tensor([end], dtype=torch.int32), 0.125, out)
            start = end
        return out

    whole = attend([length])
    for chunks in ([3, 20, 45], [17, 18, 44, 45], [1, 2, 3, 30, 45]):
        assert torch.equal(attend(chunks), whole), chunks
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:length]
    k, v = (cache[i].reshape(-1, kv_heads, 64)[slots] for i in (0, 1))
    expected = naive_attention(q, k, v, 0)
    torch.testing.assert_close(whole.double(), expected, atol=1e-2, rtol=1e-2)


def test_native_prefill_kernel_rejects_bad_input(native):
    if not native.capabilities.prefill_attention(torch.bfloat16, 64):
        pytest.skip("this CPU has no AVX512-BF16: prefills take SDPA")
    op = native.prefill_attention(torch.bfloat16, 64)
    bf16 = torch.bfloat16
    cache = torch.zeros(2, 4, BLOCK_SIZE, KV_HEADS, 64, dtype=bf16)
    q, out = torch.zeros(5, HEADS, 64, dtype=bf16), torch.zeros(5, HEADS * 64, dtype=bf16)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    ranges, lens = torch.tensor([[0, 5]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    op(q, cache[0], cache[1], tables, ranges, lens, 1.0, out)  # well formed
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(q.float(), cache[0], cache[1], tables, ranges, lens, 1.0, out)
    with pytest.raises(RuntimeError, match="int32"):
        op(q, cache[0], cache[1], tables, ranges.long(), lens, 1.0, out)
    with pytest.raises(RuntimeError, match="block table"):  # 9 keys need 3 blocks of 4
        op(q, cache[0], cache[1], tables, ranges, torch.tensor([9], dtype=torch.int32), 1.0, out)
    with pytest.raises(RuntimeError, match="queries must lie in q"):
        op(q, cache[0], cache[1], tables, torch.tensor([[3, 8]], dtype=torch.int32), lens,
           1.0, out)
    with pytest.raises(RuntimeError, match="head_dim"):
        op(q[..., :32], cache[0][..., :32].contiguous(), cache[1][..., :32].contiguous(),
           tables, ranges, lens, 1.0, out[:, : HEADS * 32])
    odd_rows = torch.zeros(5, HEADS * 64 + 1, dtype=bf16)[:, 1:].view(5, HEADS, 64)
    with pytest.raises(RuntimeError, match="strides must be even"):  # read in pairs
        op(odd_rows, cache[0], cache[1], tables, ranges, lens, 1.0, out)
