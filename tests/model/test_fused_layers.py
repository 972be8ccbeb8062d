"""The native fused layer ops (``tokenmill.kernels``) against the PyTorch forms they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.models.layers.rotary import RotaryEmbedding, apply_rotary

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# float32: the same formula, summed in another order; 16-bit: one rounding instead of
# one per PyTorch op.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = list(TOLERANCE)


@pytest.fixture
def ops(native):
    return native


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_pytorch(ops, dtype):
    x = torch.randn(37, 96).to(dtype)
    weight = torch.randn(96).to(dtype)
    close(ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (96,), weight, 1e-5), dtype)
    rows = x[::2]  # strided rows are read in place
    close(ops.rms_norm(rows, weight, 1e-5), F.rms_norm(rows, (96,), weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_pytorch(ops, dtype):
    gate_up = (torch.randn(37, 2 * 80) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(ops.silu_and_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_kv_rotates_q_and_k_and_stores_k_and_v(ops, dtype):
    tokens, num_blocks, block_size = 21, 16, 4
    rope = RotaryEmbedding(HEAD_DIM, 256, 10000.0, None, dtype, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.randint(0, 256, (tokens,)))
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    qk_width = (HEADS + KV_HEADS) * HEAD_DIM
    expected = apply_rotary(qkv[:, :qk_width].view(tokens, -1, HEAD_DIM), cos, sin)
    keys = torch.zeros(num_blocks, block_size, KV_HEADS, HEAD_DIM, dtype=dtype)
    values = torch.zeros_like(keys)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    rotated = qkv.clone()
    ops.rotary_store_kv(rotated, cos[:, 0], sin[:, 0], keys, values, slots, HEADS, KV_HEADS)

    close(rotated[:, :qk_width].view(tokens, -1, HEAD_DIM), expected, dtype)
    assert torch.equal(rotated[:, qk_width:], qkv[:, qk_width:])  # v is not rotated
    assert torch.equal(keys.view(-1, KV_HEADS * HEAD_DIM)[slots],
                       rotated[:, HEADS * HEAD_DIM:qk_width])
    assert torch.equal(values.view(-1, KV_HEADS * HEAD_DIM)[slots], qkv[:, qk_width:])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not keys.view(num_blocks * block_size, -1)[untouched].any()


def test_fused_ops_reject_mismatched_input(ops):
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="2 \\* I"):
        ops.silu_and_mul(torch.randn(2, 7))
    cache = torch.zeros(4, 4, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        ops.rotary_store_kv(torch.randn(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
                            torch.ones(1, HEAD_DIM), torch.ones(1, HEAD_DIM), cache, cache,
                            torch.zeros(1, dtype=torch.int32), HEADS, KV_HEADS)


def test_bfloat16_results_round_to_nearest_even_like_pytorch(ops):
    """With sin = 0 the rotation is x * cos: a float32 product of two bfloat16 values is
    exact, so the only rounding is the kernels' float32 to bfloat16 one, which must match
    PyTorch's bit for bit; a NaN stays a NaN."""
    gen = torch.Generator().manual_seed(0)
    tokens, width = 64, (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(tokens, width, generator=gen).to(torch.bfloat16)
    cos = torch.randn(tokens, HEAD_DIM // 2, generator=gen).to(torch.bfloat16).repeat(1, 2)
    sin = torch.zeros_like(cos)
    cache = torch.zeros(16, 4, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    rotated = qkv.clone()
    ops.rotary_store_kv(rotated, cos, sin, cache, cache.clone(), torch.arange(tokens), HEADS,
                        KV_HEADS)
    qk = (HEADS + KV_HEADS) * HEAD_DIM
    expected = (qkv[:, :qk].float().view(tokens, -1, HEAD_DIM) * cos[:, None].float())
    expected = expected.to(torch.bfloat16).view(tokens, qk)
    assert torch.equal(rotated[:, :qk], expected)
    row = torch.randn(2, 96, generator=gen).to(torch.bfloat16)
    row[0, 5] = float("nan")
    normed = ops.rms_norm(row, torch.ones(96, dtype=torch.bfloat16), 1e-5)
    assert normed[0].isnan().all() and not normed[1].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_matches_torch(ops, dtype):
    """First index of the largest value; ties, infinities, signed zeros and NaN (larger
    than everything) as torch.argmax answers them."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=gen).to(dtype)
    x[1, 10] = x[1, 900] = 50  # a tie: the first wins
    x[2] = float("-inf")  # all equal
    x[2, 700] = -1e30 if dtype != torch.float16 else -6e4
    x[3, 5], x[3, 600] = float("inf"), float("nan")
    x[4] = -1.0
    x[4, 300], x[4, 200] = 0.0, -0.0  # -0 == +0: the first
    x[5] = float("-inf")  # every value the same: index 0
    expected = x.float().argmax(dim=-1)
    assert expected[3] == 600 and expected[4] == 200  # what torch answers
    assert torch.equal(ops.argmax_rows(x), expected)
    assert torch.equal(ops.argmax_rows(x[:, 3:]), x[:, 3:].float().argmax(dim=-1))  # strided


def test_argmax_rows_rejects_bad_input(ops):
    with pytest.raises(RuntimeError, match="rows"):
        ops.argmax_rows(torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_rows_inverts_the_cumulative_distribution(ops, dtype):
    """At u = (k + 0.5) / K, K evenly spaced points, each token is picked about
    p * K times (p = softmax(logits / t)); tokens of probability 0 never, and the
    answer for each u is the one PyTorch's cumsum and searchsorted give, but where
    their float32 sums round differently at a boundary."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, 300, generator=gen) * 2).to(dtype)
    logits[0, 7] = float("-inf")  # probability 0
    points = 4000
    u = (torch.arange(points, dtype=torch.float32) + 0.5) / points
    for temperature in (1.0, 0.5):
        rows = logits.expand(points, -1).contiguous()
        picked = ops.sample_rows(rows, torch.full((points,), temperature), u)
        cdf = (logits.float() / temperature).softmax(-1).cumsum(-1)
        expected = torch.searchsorted(cdf.expand(points, -1).contiguous(),
                                      (u * cdf[0, -1]).unsqueeze(1), right=True).squeeze(1)
        assert (picked != expected).sum() <= 3
        assert not (picked == 7).any()
        counts = torch.bincount(picked, minlength=300).float()
        probs = (logits.float() / temperature).softmax(-1)[0]
        assert (counts - probs * points).abs().max() <= 2


def test_sample_rows_rejects_bad_input(ops):
    logits = torch.zeros(2, 10)
    with pytest.raises(RuntimeError, match="one per row"):
        ops.sample_rows(logits, torch.ones(3), torch.zeros(2))
    with pytest.raises(RuntimeError, match="positive"):
        ops.sample_rows(logits, torch.tensor([1.0, 0.0]), torch.zeros(2))
