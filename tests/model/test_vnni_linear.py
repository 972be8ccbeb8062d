"""The native integer-activation kernels of a CPU with AVX512-VNNI (``tokenmill.kernels``):
int8 or 4-bit weights times activations (bfloat16 or float32) quantized to int8 per block
of inputs (``activation_block``), against float64 arithmetic on the values both stand
for."""

from __future__ import annotations

import pytest
import torch

from tokenmill.models.weights.native_weights import NativeVnniW4A8Weight, NativeW8A8Weight
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


def expected(kind: type, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """(the product the kernel computes, in float64; how far a rounding of x that falls on
    a tie, or within float32 error of one, may move it). w4a8 takes each weight as
    ``scale * (q - 8) + (min + 8 * scale)`` and the second part times the exact sum of x,
    so only the centred part sees x rounded."""
    m, k = x.shape
    blocks = x.float().view(m, -1, activation_block(kind, k))
    amax = blocks.abs().amax(-1, keepdim=True)
    scaled = blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    d = (amax / 127).double()
    xq = (scaled.round().double() * d).view(m, k)
    w = weight_values(kind, weight)
    if kind is NativeW8A8Weight:
        out = xq @ w.T
    else:
        q, scales, mins = quantize_q4_1_groups(weight, GROUP, torch.float16)
        centred = (q.double() - CENTRE) * scales.double().repeat_interleave(GROUP, 1)
        rest = mins.double() + CENTRE * scales.double()
        out = xq @ centred.T + x.double().view(m, -1, GROUP).sum(-1) @ rest.T
        w = centred
    near_tie = ((scaled - scaled.floor() - 0.5).abs() < 1e-3).double() * d
    slack = near_tie.view(m, k) @ w.abs().T
    return out, slack


def assert_matches(actual: torch.Tensor, kind: type, x: torch.Tensor, weight: torch.Tensor,
                   extra: torch.Tensor) -> None:
    exact, slack = expected(kind, x, weight)
    exact = exact + extra.double()
    rounding = 2.0**-8 if actual.dtype == torch.bfloat16 else 2.0**-23  # of the output
    bound = (slack + exact.abs() * rounding
             + x.shape[1] * 2.0**-22 * exact.abs().max() * (1 + slack.max()))
    assert actual.dtype == x.dtype
    assert ((actual.double() - exact).abs() <= bound).all()


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
