"""The native w4a8 kernel (``tokenmill.kernels``, CPUs with AVX2, FMA and F16C): 4-bit weights
times activations quantized to int8 per group of 32 inputs, against float64 arithmetic on
the values both stand for."""

from __future__ import annotations

import pytest
import torch

from tokenmill.models.weights.native_weights import NativeW4A8Weight
from tokenmill.models.weights.quantize import quantize_q4_1_panels

GROUP = NativeW4A8Weight.GROUP  # inputs per weight scale and minimum, and per activation scale
CENTRE = 8  # the 4-bit value whose part of a weight does not see x rounded


@pytest.fixture
def ops(native):
    if not native.capabilities.w4a8_linear:
        pytest.skip("the w4a8 kernel needs a CPU with AVX2, FMA and F16C")
    return native


def weight_values(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scales, mins) per output row, float64: w = q * scale + min per group."""
    n, k = weight.shape
    q, scales, mins = quantize_q4_1_panels(weight, 16, GROUP, torch.float16)
    per_row = [t.transpose(1, 2).reshape(-1, t.shape[1])[:n].double() for t in (scales, mins)]
    return q.reshape(-1, k)[:n].double(), *per_row


def expected(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the product the kernel computes, in float64; how far a rounding of x that falls
    on a tie, or within float32 error of one, may move it). Each weight is taken as
    ``scale * (q - 8) + (min + 8 * scale)``, the second part times the exact sum of x, so
    only the centred part sees x rounded."""
    m, k = x.shape
    q, scales, mins = weight_values(weight)
    groups = x.reshape(m, -1, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    scaled = groups * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    d = (amax / 127).double()  # [m, groups, 1]
    xq = (scaled.round().double() * d).view(m, k)
    centred = (q - CENTRE) * scales.repeat_interleave(GROUP, dim=1)
    out = xq @ centred.T + x.double().view(m, -1, GROUP).sum(-1) @ (mins + CENTRE * scales).T
    near_tie = ((scaled - scaled.floor() - 0.5).abs() < 1e-3).double() * d
    slack = near_tie.view(m, k) @ centred.abs().T
    return out, slack


def assert_matches(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   extra: torch.Tensor | None = None) -> None:
    exact, slack = expected(x, weight)
    if extra is not None:
        exact = exact + extra.double()
    k = x.shape[1]
    bound = slack + exact.abs() * 2.0**-23 + k * 2.0**-22 * exact.abs().max()
    assert actual.dtype == torch.float32
    assert ((actual.double() - exact).abs() <= bound).all()


# rows: 1 and 4 (one register tile), 7 and 130 (several chunks of rows); outputs not a
# multiple of the 16-wide panel (nor of 8)
@pytest.mark.parametrize("rows", [1, 4, 7, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 96), (203, 32)])
def test_w4a8_matches_exact_arithmetic_on_quantized_values(ops, rows, out_features,
                                                           in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen) / 10
    bias = torch.randn(out_features, generator=gen)
    fmt = NativeW4A8Weight(ops, weight, bias)
    x = torch.randn(rows, 2 * in_features, generator=gen)[:, in_features:]  # strided rows
    x[0, :GROUP] = 0  # a group of zeros has no scale
    residual = torch.randn(rows, out_features, generator=gen)
    assert_matches(fmt(x), x, weight, bias)
    assert_matches(fmt.add(x, residual), x, weight, bias + residual)


def test_w4a8_stays_close_to_float32(ops):
    """The rounding of activations to 8 bits costs about 1% of the product, no more."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(576, 576, generator=gen) / 25
    x = torch.randn(8, 576, generator=gen)
    q, scales, mins = weight_values(weight)
    stands_for = (q * scales.repeat_interleave(GROUP, 1) + mins.repeat_interleave(GROUP, 1))
    exact = x.double() @ stands_for.T
    error = (NativeW4A8Weight(ops, weight, None)(x).double() - exact).norm() / exact.norm()
    assert error < 0.01


def test_w4a8_turns_nan_and_inf_into_nan(ops):
    fmt = NativeW4A8Weight(ops, torch.randn(16, 64), None)
    x = torch.randn(3, 64)
    x[1, 3], x[2, 40] = float("nan"), float("inf")
    out = fmt(x)
    assert torch.isfinite(out[0]).all() and out[1:].isnan().all()


def test_w4a8_recovers_q4_1_blocks(ops):
    """Weights dequantized from GGUF Q4_1 blocks (float16 scale d and minimum m per 32
    inputs, w = d * q + m) come back as the same q, d and m."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 3, GROUP), generator=gen)
    q[..., 0], q[..., 1] = 0, 15  # a Q4_1 block maps its minimum to 0 and maximum to 15
    d = (torch.rand(48, 3, 1, generator=gen) * 0.02 + 0.001).half()
    m = (-7.5 * d.float() + torch.randn(48, 3, 1, generator=gen) * d.float()).half()
    weight = (d.float() * q + m.float()).view(48, 96)
    got_q, scales, mins = weight_values(weight)
    assert torch.equal(got_q, q.view(48, 96).double())
    assert torch.equal(scales, d.view(48, 3).double()) and torch.equal(mins, m.view(48, 3).double())


def test_w4a8_rejects_bad_input(ops):
    fmt = NativeW4A8Weight(ops, torch.randn(64, 64), None)
    x, params, w4a8_linear = torch.randn(3, 64), fmt.group_params, ops.w4a8_linear()
    with pytest.raises(RuntimeError, match="float32"):
        w4a8_linear(x.bfloat16(), fmt.packed, params, 64, None, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        w4a8_linear(x[:, :48], fmt.packed, params, 64, None, None)
    with pytest.raises(RuntimeError, match="NativeW4A8Weight"):
        w4a8_linear(x, fmt.packed.view(torch.int8), params, 64, None, None)
    with pytest.raises(RuntimeError, match="group_params"):
        w4a8_linear(x, fmt.packed, params.float(), 64, None, None)
    with pytest.raises(RuntimeError, match="group_params"):
        w4a8_linear(x, fmt.packed, params[:, :1], 64, None, None)
    with pytest.raises(RuntimeError, match="residual"):
        w4a8_linear(x, fmt.packed, params, 64, None, torch.zeros(2, 64))
