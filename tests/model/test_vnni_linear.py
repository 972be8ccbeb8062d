"""The native integer-activation kernels of a CPU with AVX512-VNNI (``tokenmill.kernels``):
int8 or 4-bit weights times activations (bfloat16 or float32) quantized to int8 per block
of inputs (``activation_block``), against float64 arithmetic on the values both stand
for; and the kinds over a GGUF file's own Q4_K, Q8_0 and Q6_K blocks, against their
arithmetic step for step or w4a8's kind bit for bit."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import random_blocks

from quantization_hosts import gguf_dense_rows_here, gguf_integer_here
from tokenmill.models.gguf.blocks import FileRows
from tokenmill.models.weights.native_weights import (
    DenseAtRowsWeight,
    KernelWeight,
    NativeVnniQ4KWeight,
    NativeVnniQ6KWeight,
    NativeVnniQ8_0Weight,
    NativeVnniW4A8Weight,
    NativeW8A8Weight,
    interleave_gate_up,
)
from tokenmill.models.weights.quantize import quantize_int8_rows, quantize_q4_1_groups

GROUP = 32  # inputs per 4-bit weight scale and minimum, and per activation scale of w4a8
WIDE_BLOCK = 64  # inputs per activation scale of w8a8, where they divide a row
CENTRE = 8  # the 4-bit value whose part of a weight does not see x rounded
KINDS = (NativeW8A8Weight, NativeVnniW4A8Weight)
DTYPES = (torch.bfloat16, torch.float32)


@pytest.fixture
def ops(native):
    if not native.capabilities.vnni_linear:
        pytest.skip("the integer-activation kernels need a CPU with AVX512-VNNI")
    return native


def weight_values(kind: type, weight: torch.Tensor) -> torch.Tensor:
    """The float64 weight the packed one stands for."""
    if kind is NativeW8A8Weight:
        q, scales = quantize_int8_rows(weight)
        return q.double() * scales.double()[:, None]
    q, scales, mins = quantize_q4_1_groups(weight, GROUP, torch.float16)
    return (q.double() * scales.double().repeat_interleave(GROUP, 1)
            + mins.double().repeat_interleave(GROUP, 1))


def activation_block(kind: type, in_features: int) -> int:
    """The inputs that share one activation scale: w8a8 takes 64 where they divide a row."""
    wide = kind is NativeW8A8Weight and in_features % WIDE_BLOCK == 0
    return WIDE_BLOCK if wide else GROUP


def rounded(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x rounded per block of inputs as the kernels round it, in float64; per input the
    scale d where its rounding falls on a tie, or within float32 error of one, else 0)."""
    m, k = x.shape
    blocks = x.float().view(m, -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    scaled = blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    d = (amax / 127).double()
    near_tie = ((scaled - scaled.floor() - 0.5).abs() < 1e-3).double() * d
    return (scaled.round().double() * d).view(m, k), near_tie.view(m, k)


def centred_weights(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The part ``scale * (q - 8)`` of 4-bit weights (scales per GROUP inputs), float64."""
    return (q.double() - CENTRE) * scales.double().repeat_interleave(GROUP, 1)


def w4_expected(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the product w4a8's arithmetic computes on 4-bit weights ``q * scale + min``, in
    float64; how far a rounding of x on a tie may move it). Each weight is taken as
    ``scale * (q - 8) + (min + 8 * scale)``, the second part times the exact sum of x, so
    only the centred part sees x rounded."""
    xq, near_tie = rounded(x, GROUP)
    centred = centred_weights(q, scales, mins)
    rest = mins.double() + CENTRE * scales.double()
    out = xq @ centred.T + x.double().view(x.shape[0], -1, GROUP).sum(-1) @ rest.T
    return out, near_tie @ centred.abs().T


def expected(kind: type, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """(the product the kernel computes, in float64; how far a rounding of x that falls on
    a tie, or within float32 error of one, may move it)."""
    if kind is not NativeW8A8Weight:
        return w4_expected(x, *quantize_q4_1_groups(weight, GROUP, torch.float16))
    xq, near_tie = rounded(x, activation_block(kind, x.shape[1]))
    w = weight_values(kind, weight)
    return xq @ w.T, near_tie @ w.abs().T


def assert_within(actual: torch.Tensor, x: torch.Tensor, exact: torch.Tensor,
                  slack: torch.Tensor) -> None:
    """``actual`` is ``exact`` within the slack of x's ties, one rounding to x's dtype and
    float32 summation."""
    rounding = 2.0**-8 if actual.dtype == torch.bfloat16 else 2.0**-23  # of the output
    bound = (slack + exact.abs() * rounding
             + x.shape[1] * 2.0**-22 * exact.abs().max() * (1 + slack.max()))
    assert actual.dtype == x.dtype
    assert ((actual.double() - exact).abs() <= bound).all()


def assert_matches(actual: torch.Tensor, kind: type, x: torch.Tensor, weight: torch.Tensor,
                   extra: torch.Tensor) -> None:
    exact, slack = expected(kind, x, weight)
    assert_within(actual, x, exact + extra.double(), slack)


# rows: 1 and 6 (one chunk of rows), 7 and 130 (several chunks); outputs not a multiple of
# the 32-wide panel (nor of 16); inputs 64 (w8a8: one block of 64), 96 and 32 (blocks of 32)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 6, 7, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 96), (203, 32)])
def test_vnni_kernels_match_exact_arithmetic_on_quantized_values(ops, kind, dtype, rows,
                                                                 out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen) / 10
    bias = torch.randn(out_features, generator=gen).to(dtype)
    packed = kind(ops, weight, bias)
    x = torch.randn(rows, 2 * in_features, generator=gen).to(dtype)[:, in_features:]
    x[0, :activation_block(kind, in_features)] = 0  # a block of zeros has no scale
    residual = torch.randn(rows, out_features, generator=gen).to(dtype)
    assert_matches(packed(x), kind, x, weight, bias)
    assert_matches(packed.add(x, residual), kind, x, weight, bias.double() + residual.double())


@pytest.mark.parametrize("kind", KINDS)
def test_vnni_kernels_stay_close_to_float32(ops, kind):
    """The rounding of activations to 8 bits costs about 1% of the product, no more."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(576, 576, generator=gen) / 25
    x = torch.randn(8, 576, generator=gen)
    exact = x.double() @ weight_values(kind, weight).T
    error = (kind(ops, weight, None)(x).double() - exact).norm() / exact.norm()
    assert error < 0.01


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_vnni_kernels_turn_nan_and_inf_into_nan(ops, kind, dtype):
    packed = kind(ops, torch.randn(16, 64), None)
    x = torch.randn(3, 64).to(dtype)
    x[1, 3], x[2, 40] = float("nan"), float("inf")
    out = packed(x)
    assert torch.isfinite(out[0]).all() and out[1:].isnan().all()


def test_vnni_kernels_reject_bad_input(ops):
    w8 = NativeW8A8Weight(ops, torch.randn(64, 64), None)
    w4 = NativeVnniW4A8Weight(ops, torch.randn(64, 64), None)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        w8.linear(x.half(), w8.packed, w8.scales, 64, None, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        w8.linear(x[:, :48], w8.packed, w8.scales, 64, None, None)
    with pytest.raises(RuntimeError, match="NativeW8A8Weight"):
        w8.linear(x, w4.packed, w8.scales, 64, None, None)
    with pytest.raises(RuntimeError, match="scales"):
        w8.linear(x, w8.packed, w8.scales[:16], 64, None, None)
    with pytest.raises(RuntimeError, match="NativeVnniW4A8Weight"):
        w4.linear(x, w8.packed, w4.group_params, 64, None, None)
    with pytest.raises(RuntimeError, match="group_params"):
        w4.linear(x, w4.packed, w4.group_params.float(), 64, None, None)
    with pytest.raises(RuntimeError, match="residual"):
        w4.linear(x, w4.packed, w4.group_params, 64, None, torch.zeros(3, 64).bfloat16())
    with pytest.raises(RuntimeError, match="bias"):
        w8.linear(x.bfloat16(), w8.packed, w8.scales, 64, torch.zeros(64), None)


# --- a GGUF file's own Q4_K, Q8_0 and Q6_K blocks (``GGUFFormat`` on a VNNI host)

GGUF_KINDS = {Q.Q4_K: NativeVnniQ4KWeight, Q.Q8_0: NativeVnniQ8_0Weight,
              Q.Q6_K: NativeVnniQ6KWeight}
# the int8 kinds: inputs per weight scale and activation scale, and the stored byte's offset
INT8_GROUPS = {Q.Q8_0: (32, 128), Q.Q6_K: (16, 32)}
ROWS = (1, 5, 7, 16, 33)


@pytest.fixture
def gguf_ops(native):
    """The kernels, where the host runs the VNNI ones (``quantization_hosts``)."""
    if not gguf_integer_here(native.capabilities):
        pytest.skip("the kernels over a GGUF file's blocks need a CPU with AVX512-VNNI")
    return native


def file_rows(qtype, out_features: int, in_features: int, seed: int) -> FileRows:
    """Random valid blocks of ``qtype`` (every bit pattern; scales up to 0.05)."""
    data = random_blocks(qtype, out_features, in_features, np.random.default_rng(seed), 0.05)
    return FileRows(qtype, data, in_features)


def pack_rows(ops, rows: FileRows, bias: torch.Tensor | None):
    shape = torch.empty(1).expand(*rows.shape)
    return GGUF_KINDS[rows.qtype](ops, shape, bias, rows.own_fields())


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 ``a * b + c`` rounded once (through float64, where ``a * b`` is exact)."""
    return (a.double() * b.double() + c.double()).float()


def int8_groups_arithmetic(x: torch.Tensor, rows: FileRows, bias: torch.Tensor | None,
                           residual: torch.Tensor | None) -> torch.Tensor:
    """The int8 kinds' arithmetic in torch, step for step: x rounded per group of the
    weights' scales, integer sums of the stored bytes less the offset's part, then per
    group in order ``acc = fma(sum * d, scale, acc)``, the bias and the residual added in
    float32, one rounding to x's dtype. (Fast math lets the build reorder ``x * (127 /
    amax)``: x must hold no input within float32 error of a rounding tie, ``clear_ties``.)"""
    group, offset = INT8_GROUPS[rows.qtype]
    q, scales = rows.int8_groups()
    m, k = x.shape
    blocks = x.float().view(m, k // group, group)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xq = (blocks * inv[..., None]).round().long()
    d = amax * torch.tensor(1 / 127, dtype=torch.float32)  # fast math folds / 127 so
    stored = q.long() + offset
    sums = torch.einsum("mbg,nbg->mnb", xq, stored.view(-1, k // group, group))
    sums = sums - offset * xq.sum(-1)[:, None, :]
    acc = torch.zeros(m, q.shape[0])
    for b in range(k // group):
        acc = fma32(sums[:, :, b].float() * d[:, b, None], scales[:, b], acc)
    if bias is not None:
        acc = acc + bias.float()
    if residual is not None:
        acc = acc + residual.float()
    return acc.to(x.dtype)


def clear_ties(x: torch.Tensor, group: int) -> None:
    """Sets to 0, in place, each input of x that a rounding per ``group`` inputs puts
    within 1e-3 of a tie (never a block's largest, so its scale stays)."""
    _, near_tie = rounded(x, group)
    x[near_tie > 0] = 0


@pytest.mark.parametrize("qtype", INT8_GROUPS, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features", [37, 64])
def test_int8_gguf_kinds_are_their_arithmetic_bit_for_bit(gguf_ops, qtype, dtype, rows,
                                                          out_features):
    """Q8_0 (q + 128 stored) and Q6_K (q stored, offset 32) with their file's scales:
    the kernel equals its arithmetic done in torch, with a bias and a residual or none;
    a row's output is the same alone as in the batch."""
    blocks = file_rows(qtype, out_features, 512, rows)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, 1024, generator=gen).to(dtype)[:, 512:]
    x[0, :INT8_GROUPS[qtype][0]] = 0  # a block of zeros has no scale
    clear_ties(x, INT8_GROUPS[qtype][0])
    residual = torch.randn(rows, out_features, generator=gen).to(dtype)
    plain, biased = pack_rows(gguf_ops, blocks, None), pack_rows(gguf_ops, blocks, bias)
    assert torch.equal(plain(x), int8_groups_arithmetic(x, blocks, None, None))
    got = biased.add(x, residual)
    assert torch.equal(got, int8_groups_arithmetic(x, blocks, bias, residual))
    alone = torch.cat([biased.add(x[r:r + 1], residual[r:r + 1]) for r in range(rows)])
    assert torch.equal(alone, got)


@pytest.mark.parametrize("qtype", INT8_GROUPS, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_int8_gguf_kinds_gate_their_float32_sums(gguf_ops, qtype, dtype, rows):
    """A gated call: each panel's halves are 16 gate and 16 up outputs, and the call gives
    silu(gate) * up of the plain call's float32 sums (float32 x gives them), rounded
    once."""
    blocks = file_rows(qtype, 96, 512, rows)
    packed = pack_rows(gguf_ops, blocks, None)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) / 100
    x = x.to(dtype)  # small: gates of a few units, as in a model
    sums = packed(x.float()).double().view(rows, 3, 2, 16)
    expected = (torch.nn.functional.silu(sums[:, :, 0]) * sums[:, :, 1]).reshape(rows, 48)
    out = packed.linear(x, packed.packed, packed.group_params, 96, None, None, gated=True)
    assert out.shape == (rows, 48) and out.dtype == dtype
    relative = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    bound = expected.abs() * relative + 1e-6 * expected.abs().max()
    assert ((out.double() - expected).abs() <= bound).all()


def k_fields_as_float16(out_features: int, in_features: int, seed: int):
    """Q4_K fields whose d and dmin are powers of two: each block's scale d sc and minimum
    -(dmin mn) are float16 numbers, so w4a8's float16 kind holds the same weights."""
    gen = torch.Generator().manual_seed(seed)
    supers = (out_features, in_features // 256)
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    sc, mn = (torch.randint(0, 64, (out_features, in_features // 32), generator=gen,
                            dtype=torch.uint8) for _ in range(2))
    d, dmin = (torch.pow(2.0, -torch.randint(10, 15, supers, generator=gen)).half()
               for _ in range(2))
    return q, sc, mn, d, dmin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features", [37, 64])
def test_q4_k_kind_equals_w4a8_where_float16_holds_its_parameters(gguf_ops, dtype, rows,
                                                                  out_features):
    """The same arithmetic as w4a8's kind (its parameters read from Q4_K's fields instead of
    float16 pairs): bit for bit, plain, with a bias and a residual, and gated."""
    q, sc, mn, d, dmin = fields = k_fields_as_float16(out_features, 512, rows)
    scales = (d.float().repeat_interleave(8, 1) * sc.float()).half()
    mins = -(dmin.float().repeat_interleave(8, 1) * mn.float()).half()
    shape = torch.empty(1).expand(out_features, 512)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    k_kind = NativeVnniQ4KWeight(gguf_ops, shape, bias, fields)
    w4 = NativeVnniW4A8Weight(gguf_ops, shape, bias, (q, scales, mins))
    x = torch.randn(rows, 512, generator=gen).to(dtype)
    residual = torch.randn(rows, out_features, generator=gen).to(dtype)
    assert torch.equal(k_kind(x), w4(x))
    assert torch.equal(k_kind.add(x, residual), w4.add(x, residual))
    if out_features % 32 == 0:
        gated = [w.linear(x, w.packed, w.group_params, out_features, None, None, gated=True)
                 for w in (NativeVnniQ4KWeight(gguf_ops, shape, None, fields),
                           NativeVnniW4A8Weight(gguf_ops, shape, None, (q, scales, mins)))]
        assert gated[0].shape == (rows, out_features // 2)
        assert torch.equal(*gated)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_q4_k_kind_on_file_blocks_matches_exact_arithmetic(gguf_ops, dtype, rows):
    """Random Q4_K blocks (every bit pattern): the kernel computes with the file's scale and
    minimum per 32 inputs exactly (``int4_planes``' float32 values, the reference
    dequantization), within w4a8's rounding of x."""
    blocks = file_rows(Q.Q4_K, 37, 512, rows)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(37, generator=gen).to(dtype)
    x = torch.randn(rows, 512, generator=gen).to(dtype)
    residual = torch.randn(rows, 37, generator=gen).to(dtype)
    got = pack_rows(gguf_ops, blocks, bias).add(x, residual)
    exact, slack = w4_expected(x, *blocks.int4_planes()[0])
    assert_within(got, x, exact + bias.double() + residual.double(), slack)


@pytest.mark.parametrize("qtype", GGUF_KINDS, ids=lambda q: q.name)
def test_gguf_kinds_stay_close_to_float32(gguf_ops, qtype):
    """The rounding of activations to 8 bits costs about 1% of the product, no more."""
    blocks = file_rows(qtype, 256, 512, 3)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ blocks.dequantize().double().T
    error = (pack_rows(gguf_ops, blocks, None)(x).double() - exact).norm() / exact.norm()
    assert error < 0.01


@pytest.mark.parametrize("qtype", GGUF_KINDS, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gguf_kinds_turn_nan_and_inf_into_nan(gguf_ops, qtype, dtype):
    packed = pack_rows(gguf_ops, file_rows(qtype, 16, 256, 4), None)
    x = torch.randn(3, 256).to(dtype)
    x[1, 3], x[2, 200] = float("nan"), float("inf")
    out = packed(x)
    assert torch.isfinite(out[0]).all() and out[1:].isnan().all()


def test_gguf_kinds_reject_bad_input(gguf_ops):
    q4_k, q6_k = (pack_rows(gguf_ops, file_rows(qtype, 64, 512, 5), None)
                  for qtype in (Q.Q4_K, Q.Q6_K))
    x = torch.randn(3, 512)
    with pytest.raises(RuntimeError, match="multiple of 256"):  # whole super-blocks
        q4_k.linear(x[:, :480], q4_k.packed, q4_k.group_params[:, :480 // 32 * 80].contiguous(),
                    64, None, None)
    with pytest.raises(RuntimeError, match="NativeVnniQ4KWeight"):
        q4_k.linear(x, q6_k.packed, q4_k.group_params, 64, None, None)
    with pytest.raises(RuntimeError, match="params"):
        q6_k.linear(x, q6_k.packed, q4_k.group_params, 64, None, None)
    with pytest.raises(RuntimeError, match="params"):
        q6_k.linear(x, q6_k.packed, q6_k.group_params[:, :-1], 64, None, None)


# --- the dense path: the packed weight dequantized to bfloat16 for a call of many rows


def pack_file_rows(ops, rows: FileRows, dtype: torch.dtype,
                   bias: torch.Tensor | None = None) -> DenseAtRowsWeight:
    """``rows`` in their VNNI kind for ``dtype`` activations: Q4_0 and Q4_1 as w4a8's
    float16 scales and minimums (``GGUFFormat``'s route), the others their own fields."""
    shape = torch.empty(1, dtype=dtype).expand(*rows.shape)
    if rows.qtype in (Q.Q4_0, Q.Q4_1):
        q, scales, mins = rows.int4_planes()[0]
        return NativeVnniW4A8Weight(ops, shape, bias, (q, scales.half(), mins.half()))
    return GGUF_KINDS[rows.qtype](ops, shape, bias, rows.own_fields())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_1, Q.Q4_0])
@pytest.mark.parametrize("out_features", [64, 70])
def test_dequantize_is_the_file_values_rounded_to_bfloat16(gguf_ops, qtype, out_features):
    """Bit for bit, a partial last panel and (Q8_0, Q4_x) a last chunk of 32 inputs too;
    Q4_0 as numbers: w4a8 takes it as ``d q + (-8 d)``, +0 where the file's ``d (q - 8)``
    is -0."""
    in_features = 512 if qtype in (Q.Q4_K, Q.Q6_K) else 288
    rows = file_rows(qtype, out_features, in_features, seed=out_features)
    dense = pack_file_rows(gguf_ops, rows, torch.float32).dense_weight()
    expected = rows.dequantize().bfloat16()
    assert dense.dtype == torch.bfloat16 and dense.shape == expected.shape
    if qtype == Q.Q4_0:
        assert torch.equal(dense, expected)
    else:
        assert torch.equal(dense.view(torch.int16), expected.view(torch.int16))


def test_dequantize_rejects_bad_input(gguf_ops):
    w = pack_file_rows(gguf_ops, file_rows(Q.Q4_K, 64, 256, seed=1), torch.float32)
    dequantize = gguf_ops.vnni_linear().dequantize
    with pytest.raises(RuntimeError, match="kind must be"):
        dequantize("q5_k", w.packed, w.group_params, 64, 256)
    with pytest.raises(RuntimeError, match="packed must be"):
        dequantize("q4_k", w.packed, w.group_params, 64, 512)
    with pytest.raises(RuntimeError, match="params must be"):
        dequantize("q4_k", w.packed, w.group_params[:, 1:].contiguous(), 64, 256)


@pytest.fixture
def dense_ops(native):
    """The kernels, where the VNNI kinds take many bfloat16 rows densely
    (``quantization_hosts``)."""
    if not gguf_dense_rows_here(native.capabilities):
        pytest.skip("the dense path of the VNNI kinds needs AVX512-VNNI and AMX tiles")
    return native


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_1])
def test_calls_from_dense_rows_take_the_bfloat16_product(dense_ops, qtype):
    """From ``DENSE_ROWS`` rows: ``F.linear`` over the dequantized weight (+ residual);
    below: the integer kernel, each row as in any batch of it."""
    in_features = 512
    rows = file_rows(qtype, 96, in_features, seed=3)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(96, generator=gen).bfloat16()
    w = pack_file_rows(dense_ops, rows, torch.bfloat16, bias)
    n = DenseAtRowsWeight.DENSE_ROWS
    assert n > 64  # the engine's default max_num_seqs: decode rows take the integer kernel
    x = torch.randn(n, in_features, generator=gen).bfloat16()
    residual = torch.randn(n, 96, generator=gen).bfloat16()
    product = torch.nn.functional.linear(x, w.dense_weight(), bias)
    assert torch.equal(w(x), product)
    assert torch.equal(w.add(x, residual), residual + product)
    integer = KernelWeight.__call__(w, x)
    assert not torch.equal(integer, product)
    assert torch.equal(w(x[:n - 1]), integer[:n - 1])
    assert torch.equal(w.add(x[:n - 1], residual[:n - 1]),
                       KernelWeight.add(w, x, residual)[:n - 1])


def test_dense_product_in_chunks_is_the_whole_product(dense_ops):
    """A weight of several ``DENSE_CHUNK_BYTES`` chunks, the last one partial: oneDNN's
    product chunk by chunk (within rounding of the whole weight's: its sums' order may
    depend on the outputs' count)."""
    in_features = 8192
    chunk_outputs = DenseAtRowsWeight.DENSE_CHUNK_BYTES // (2 * in_features)
    out_features = 2 * chunk_outputs + 40
    rows = file_rows(Q.Q8_0, out_features, in_features, seed=5)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(out_features, generator=gen).bfloat16()
    w = pack_file_rows(dense_ops, rows, torch.bfloat16, bias)
    x = torch.randn(DenseAtRowsWeight.DENSE_ROWS, in_features, generator=gen).bfloat16()
    dense = w.dense_weight()
    assert torch.equal(dense, rows.dequantize().bfloat16())
    chunks = [torch.nn.functional.linear(x, dense[i:i + chunk_outputs],
                                         bias[i:i + chunk_outputs])
              for i in range(0, out_features, chunk_outputs)]
    y = w(x)
    assert torch.equal(y, torch.cat(chunks, dim=1))
    torch.testing.assert_close(y, torch.nn.functional.linear(x, dense, bias), rtol=0.016,
                               atol=1e-3)


def test_weights_quantized_here_keep_the_integer_kernel_at_every_row_count(dense_ops):
    """``--quantization w4a8`` (``batch_invariant`` may take it): each row alone."""
    gen = torch.Generator().manual_seed(6)
    weight = (torch.randn(64, 256, generator=gen) * 0.05).bfloat16()
    w = NativeVnniW4A8Weight(dense_ops, weight, None)
    x = torch.randn(DenseAtRowsWeight.DENSE_ROWS, 256, generator=gen).bfloat16()
    assert torch.equal(w(x), torch.cat([w(row) for row in x.split(1)]))


def test_gated_call_from_dense_rows_gates_the_bfloat16_product(dense_ops):
    in_features, intermediate = 256, 64
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(2 * intermediate, in_features, generator=gen) * 0.05).bfloat16()
    groups = quantize_q4_1_groups(interleave_gate_up(weight), GROUP, torch.float16)
    w = NativeVnniW4A8Weight(dense_ops, weight, None, groups)
    w.linear = functools.partial(w.linear, gated=True)
    x = torch.randn(DenseAtRowsWeight.DENSE_ROWS, in_features, generator=gen).bfloat16()
    dense = w.dense_weight()
    gate, up = torch.nn.functional.linear(x, dense.view(-1, 2, 16, in_features).transpose(
        0, 1).reshape(2 * intermediate, in_features)).chunk(2, dim=1)
    assert torch.equal(w(x), torch.nn.functional.silu(gate) * up)
