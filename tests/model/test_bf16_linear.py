"""The native linear kernels (``tokenmill.kernels``, AVX512-BF16 hosts: bfloat16, int8 or
int4 weights, bfloat16 activations) against float64 arithmetic on the same values: exact
products summed in float32, one rounding at the end."""

from __future__ import annotations

import pytest
import torch
from int8_groups import group_weight, int8_groups

from tokenmill.models.weights.native_weights import NativeInt4Weight, NativeInt8GroupWeight

BF16 = torch.bfloat16


@pytest.fixture
def ops(native):
    """The bfloat16 linear kernels."""
    if not native.capabilities.bf16_linear:
        pytest.skip("this CPU has no AVX512-BF16: bfloat16 weights take oneDNN's kernels")
    return native.linear_kernels(BF16)


def expected(x, weight, bias=None, residual=None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    if bias is not None:
        out += bias.double()
    if residual is not None:
        out += residual.double()
    return out


def assert_one_rounding(actual: torch.Tensor, exact: torch.Tensor, k: int) -> None:
    """Within one bfloat16 rounding of the exact result, plus float32 summation error."""
    bound = exact.abs() * 2.0**-8 + k * 2.0**-22 * exact.abs().max()
    assert ((actual.double() - exact).abs() <= bound).all()


# rows: 1 (a decode step), 13 (two row chunks), 40 (four), 130 (a prefill: many chunks);
# outputs not a multiple of the 32-wide panel; an odd input size.
@pytest.mark.parametrize("rows", [1, 13, 40, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 10), (200, 33)])
def test_linear_matches_exact_arithmetic(ops, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(BF16)
    x = torch.randn(rows, in_features, generator=gen).to(BF16)
    bias = torch.randn(out_features, generator=gen).to(BF16)
    residual = torch.randn(rows, out_features, generator=gen).to(BF16)
    packed = ops.pack_weight(weight)

    plain = ops.linear(x, packed, out_features, None, None)
    assert plain.dtype == BF16 and plain.shape == (rows, out_features)
    assert_one_rounding(plain, expected(x, weight), in_features)
    assert_one_rounding(ops.linear(x, packed, out_features, bias, residual),
                        expected(x, weight, bias, residual), in_features)


def test_linear_reads_strided_rows_in_place(ops):
    weight = torch.randn(64, 48).to(BF16)
    wide = torch.randn(9, 100).to(BF16)
    x = wide[:, 20:68]  # rows 100 apart
    residual = torch.randn(9, 128).to(BF16)[:, :64]
    out = ops.linear(x, ops.pack_weight(weight), 64, None, residual)
    assert_one_rounding(out, expected(x, weight, residual=residual), 48)


def test_linear_keeps_nan_and_inf(ops):
    weight = torch.ones(32, 4, dtype=BF16)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [float("nan"), 0, 0, 0], [float("inf"), 0, 0, 0]],
                     dtype=BF16)
    out = ops.linear(x, ops.pack_weight(weight), 32, None, None).float()
    assert (out[0] == 10).all() and out[1].isnan().all() and (out[2] == float("inf")).all()


def test_linear_rejects_bad_input(ops):
    weight = torch.randn(64, 32).to(BF16)
    packed = ops.pack_weight(weight)
    x = torch.randn(3, 32).to(BF16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear(x.float(), packed, 64, None, None)
    with pytest.raises(RuntimeError, match="packing"):
        ops.linear(torch.randn(3, 30).to(BF16), packed, 64, None, None)
    with pytest.raises(RuntimeError, match="packing"):
        ops.linear(x, packed, 96, None, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear(x, packed, 64, torch.zeros(63, dtype=BF16), None)
    with pytest.raises(RuntimeError, match="residual"):
        ops.linear(x, packed, 64, None, torch.zeros(2, 64, dtype=BF16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.pack_weight(weight.float())


@pytest.mark.parametrize("rows", [1, 13, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 11)])
def test_int8_linear_matches_exact_arithmetic(ops, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows + out_features)
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_features, generator=gen) / 100
    x = torch.randn(rows, in_features, generator=gen).to(BF16)
    bias = torch.randn(out_features, generator=gen).to(BF16)
    residual = torch.randn(rows, out_features, generator=gen).to(BF16)
    packed = ops.int8_pack_weight(q)
    weight = q.double() * scales.double()[:, None]  # what the int8 values stand for

    out = ops.int8_linear(x, packed, scales, out_features, bias, residual)
    assert out.dtype == BF16 and out.shape == (rows, out_features)
    assert_one_rounding(out, expected(x, weight, bias, residual), in_features)


def test_int8_linear_rejects_bad_input(ops):
    packed = ops.int8_pack_weight(torch.zeros(64, 32, dtype=torch.int8))
    x = torch.randn(3, 32).to(BF16)
    with pytest.raises(RuntimeError, match="scales"):
        ops.int8_linear(x, packed, torch.ones(64, dtype=BF16), 64, None, None)
    with pytest.raises(RuntimeError, match="int8_pack_weight"):  # a bfloat16 packing
        ops.int8_linear(x, ops.pack_weight(torch.zeros(64, 32, dtype=BF16)),
                        torch.ones(64), 64, None, None)
    with pytest.raises(RuntimeError, match="int8"):
        ops.int8_pack_weight(torch.zeros(64, 32))


# rows: 1, 13 (three chunks of rows), 130 (many); groups of 16 also over 48 inputs (three
# groups, K not a multiple of 32)
@pytest.mark.parametrize("rows", [1, 13, 130])
@pytest.mark.parametrize("group,out_features,in_features",
                         [(32, 96, 64), (32, 37, 96), (16, 96, 64), (16, 37, 48)])
def test_int8_group_linear_matches_exact_arithmetic(ops, native, rows, group, out_features,
                                                    in_features):
    """int8 with a float16-valued scale per 32 or per 16 inputs (the kernel infers which
    from the scales' shape): each group's float32 sum of x q times its scale, summed in
    float32, rounded once."""
    gen = torch.Generator().manual_seed(rows + out_features)
    q, scales = int8_groups(out_features, in_features, gen, group)
    bias = torch.randn(out_features, generator=gen).to(BF16)
    fmt = NativeInt8GroupWeight(native, torch.empty(out_features, in_features, dtype=BF16),
                                bias, (q, scales))
    assert fmt.group == group
    x = torch.randn(rows, 2 * in_features, generator=gen).to(BF16)[:, in_features:]
    residual = torch.randn(rows, out_features, generator=gen).to(BF16)
    weight = group_weight(q, scales)
    assert_one_rounding(fmt(x), expected(x, weight, bias), in_features)
    assert_one_rounding(fmt.add(x, residual), expected(x, weight, bias, residual), in_features)


def test_int8_group_linear_rejects_bad_input(ops, native):
    fmt = NativeInt8GroupWeight(native, torch.empty(64, 64, dtype=BF16), None,
                                int8_groups(64, 64, torch.Generator().manual_seed(0)))
    x = torch.randn(3, 64).to(BF16)
    with pytest.raises(RuntimeError, match="one group per 16 or per 32 inputs"):
        ops.int8_group_linear(x[:, :48], fmt.packed, fmt.scales, 64, None, None)  # 24 each
    with pytest.raises(RuntimeError, match="one group per 16 or per 32 inputs"):
        ops.int8_group_linear(x, fmt.packed, fmt.scales[:, :1], 64, None, None)  # 64
    with pytest.raises(RuntimeError, match="scales must be"):  # one panel of two
        ops.int8_group_linear(x, fmt.packed, fmt.scales[:1], 64, None, None)
    with pytest.raises(ValueError, match="groups of 16 or 32"):
        NativeInt8GroupWeight(native, torch.empty(64, 64, dtype=BF16), None,
                              (torch.zeros(64, 64, dtype=torch.int8), torch.ones(64, 1)))
    with pytest.raises(RuntimeError, match="int8_pack_weight"):  # a bfloat16 packing
        ops.int8_group_linear(x, ops.pack_weight(torch.zeros(64, 64, dtype=BF16)),
                              fmt.scales, 64, None, None)


@pytest.mark.parametrize("rows", [1, 7, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 96)])
def test_int4_linear_matches_exact_arithmetic(ops, native, rows, out_features, in_features):
    """NativeInt4Weight packs; the kernel computes with the values it stands for,
    q * scale + min per group of 32 inputs."""
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) / 10).to(BF16).float()
    bias = torch.randn(out_features, generator=gen).to(BF16)
    fmt = NativeInt4Weight(native, weight.to(BF16), bias)
    groups = weight.view(out_features, -1, NativeInt4Weight.GROUP)
    low = groups.amin(-1, keepdim=True)
    step = (groups.amax(-1, keepdim=True) - low) / 15
    stands_for = (((groups - low) / step).round().clamp(0, 15) * step + low).view_as(weight)
    x = torch.randn(rows, in_features, generator=gen).to(BF16)
    residual = torch.randn(rows, out_features, generator=gen).to(BF16)
    assert_one_rounding(fmt.add(x, residual),
                        expected(x, stands_for, fmt.bias, residual), in_features)


def test_int4_linear_rejects_bad_input(ops, native):
    fmt = NativeInt4Weight(native, torch.randn(64, 64).to(BF16), None)
    x = torch.randn(3, 64).to(BF16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.int4_linear(x[:, :48], fmt.packed, fmt.scales, fmt.mins, 64, None, None)
    with pytest.raises(RuntimeError, match="scales and mins"):
        ops.int4_linear(x, fmt.packed, fmt.scales[:, :1], fmt.mins, 64, None, None)
    with pytest.raises(RuntimeError, match="int4 packing"):
        ops.int4_linear(x, fmt.packed.view(torch.int8), fmt.scales, fmt.mins, 64, None, None)
