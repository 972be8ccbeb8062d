"""The native float32 linear kernels (``tokenmill.kernels``, every host with AVX2 and FMA,
AVX-512 ones too: float32, int8 or int4 weights, float32 activations) against float64
arithmetic on the same values: float32 products and sums, so within float32 summation
error."""

from __future__ import annotations

import pytest
import torch
from int8_groups import group_weight, int8_groups

from tokenmill.models.weights.native_weights import NativeInt4Weight, NativeInt8GroupWeight


@pytest.fixture
def ops(native):
    """The float32 linear kernels."""
    if not native.capabilities.f32_linear:
        pytest.skip("this CPU lacks AVX2 or FMA: the float32 kernels are not built for it")
    return native.linear_kernels(torch.float32)


def expected(x, weight, bias=None, residual=None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    if bias is not None:
        out += bias.double()
    if residual is not None:
        out += residual.double()
    return out


def assert_float32_sums(actual: torch.Tensor, exact: torch.Tensor, k: int) -> None:
    """Within the error of summing k float32 products (plus the output's own rounding)."""
    assert actual.dtype == torch.float32
    bound = exact.abs() * 2.0**-23 + k * 2.0**-22 * exact.abs().max()
    assert ((actual.double() - exact).abs() <= bound).all()


# rows: 1 and 2 (decode steps: several panels at once), 7 (two row chunks), 40 (seven), 130
# (a prefill: many chunks); outputs not a multiple of the 16-wide panel (nor of 8).
@pytest.mark.parametrize("rows", [1, 2, 7, 40, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 10), (203, 33)])
def test_linear_matches_exact_arithmetic(ops, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    residual = torch.randn(rows, out_features, generator=gen)
    packed = ops.pack_weight(weight)

    plain = ops.linear(x, packed, out_features, None, None)
    assert plain.shape == (rows, out_features)
    assert_float32_sums(plain, expected(x, weight), in_features)
    assert_float32_sums(ops.linear(x, packed, out_features, bias, residual),
                        expected(x, weight, bias, residual), in_features)


# One or two rows take several panels at once (13 panels here: groups and a remainder on
# each thread); more rows take them one by one (or, int8 from 13 rows, through a float32
# copy). Each output is the same chain of FMAs either way (int8 groups: over the same
# weights q * scale), so a row's result is bitwise the same alone, in a pair or in a batch.
@pytest.mark.parametrize("kind", ["float32", "int8", "int8_group32", "int8_group16"])
def test_linear_rows_do_not_depend_on_their_batch(ops, native, kind):
    gen = torch.Generator().manual_seed(7)
    out_features = 203
    in_features = 96 if kind.startswith("int8_group") else 70  # int8 groups: whole groups
    x = torch.randn(40, in_features, generator=gen)
    if kind.startswith("int8_group"):
        group = int(kind.removeprefix("int8_group"))
        linear = NativeInt8GroupWeight(native, x.new_empty(out_features, in_features), None,
                                       int8_groups(out_features, in_features, gen, group))
    elif kind == "float32":
        packed = ops.pack_weight(torch.randn(out_features, in_features, generator=gen))

        def linear(rows):
            return ops.linear(rows, packed, out_features, None, None)
    else:
        q = torch.randint(-127, 128, (out_features, in_features), generator=gen,
                          dtype=torch.int8)
        packed, scales = ops.int8_pack_weight(q), torch.rand(out_features, generator=gen)

        def linear(rows):
            return ops.int8_linear(rows, packed, scales, out_features, None, None)
    batch = linear(x)
    for size in (1, 2, 3, 7):
        for start in range(0, 8, size):
            assert torch.equal(linear(x[start:start + size]), batch[start:start + size])


def test_linear_reads_strided_rows_in_place(ops):
    weight = torch.randn(64, 48)
    x = torch.randn(9, 100)[:, 20:68]  # rows 100 apart
    residual = torch.randn(9, 128)[:, :64]
    out = ops.linear(x, ops.pack_weight(weight), 64, None, residual)
    assert_float32_sums(out, expected(x, weight, residual=residual), 48)


def test_linear_keeps_nan_and_inf(ops):
    weight = torch.ones(16, 4)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [float("nan"), 0, 0, 0], [float("inf"), 0, 0, 0]])
    out = ops.linear(x, ops.pack_weight(weight), 16, None, None)
    assert (out[0] == 10).all() and out[1].isnan().all() and (out[2] == float("inf")).all()


def test_linear_rejects_bad_input(ops):
    weight = torch.randn(64, 32)
    packed = ops.pack_weight(weight)
    x = torch.randn(3, 32)
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear(x.bfloat16(), packed, 64, None, None)
    with pytest.raises(RuntimeError, match="packing"):
        ops.linear(torch.randn(3, 30), packed, 64, None, None)
    with pytest.raises(RuntimeError, match="packing"):
        ops.linear(x, packed, 96, None, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear(x, packed, 64, torch.zeros(63), None)
    with pytest.raises(RuntimeError, match="residual"):
        ops.linear(x, packed, 64, None, torch.zeros(2, 64))
    with pytest.raises(RuntimeError, match="float32"):
        ops.pack_weight(weight.bfloat16())


@pytest.mark.parametrize("rows", [1, 2, 13, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 11)])
def test_int8_linear_matches_exact_arithmetic(ops, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows + out_features)
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_features, generator=gen) / 100
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    residual = torch.randn(rows, out_features, generator=gen)
    packed = ops.int8_pack_weight(q)
    weight = q.double() * scales.double()[:, None]  # what the int8 values stand for

    out = ops.int8_linear(x, packed, scales, out_features, bias, residual)
    assert out.shape == (rows, out_features)
    assert_float32_sums(out, expected(x, weight, bias, residual), in_features)


# rows: 1 and 2 (several panels at once), 7 (row chunks), 130 (a widened copy of each
# panel); groups of 16 also over 48 inputs (three groups, K not a multiple of 32)
@pytest.mark.parametrize("rows", [1, 2, 7, 130])
@pytest.mark.parametrize("group,out_features,in_features",
                         [(32, 96, 64), (32, 203, 96), (16, 96, 64), (16, 203, 48)])
def test_int8_group_linear_matches_exact_arithmetic(ops, native, rows, group, out_features,
                                                    in_features):
    """int8 with a float16-valued scale per 32 or per 16 inputs (the kernel infers which
    from the scales' shape): x times the exact weights q * scale, summed in float32."""
    gen = torch.Generator().manual_seed(rows + out_features)
    q, scales = int8_groups(out_features, in_features, gen, group)
    bias = torch.randn(out_features, generator=gen)
    fmt = NativeInt8GroupWeight(native, torch.empty(out_features, in_features), bias,
                                (q, scales))
    assert fmt.group == group
    x = torch.randn(rows, 2 * in_features, generator=gen)[:, in_features:]  # strided rows
    residual = torch.randn(rows, out_features, generator=gen)
    weight = group_weight(q, scales)
    assert_float32_sums(fmt(x), expected(x, weight, bias), in_features)
    assert_float32_sums(fmt.add(x, residual), expected(x, weight, bias, residual), in_features)


def test_int8_group_linear_rejects_bad_input(ops, native):
    fmt = NativeInt8GroupWeight(native, torch.empty(64, 64), None,
                                int8_groups(64, 64, torch.Generator().manual_seed(0)))
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="one group per 16 or per 32 inputs"):
        ops.int8_group_linear(x[:, :48], fmt.packed, fmt.scales, 64, None, None)  # 24 each
    with pytest.raises(RuntimeError, match="one group per 16 or per 32 inputs"):
        ops.int8_group_linear(x, fmt.packed, fmt.scales[:, :1], 64, None, None)  # 64
    with pytest.raises(RuntimeError, match="scales must be"):  # one panel of four
        ops.int8_group_linear(x, fmt.packed, fmt.scales[:1], 64, None, None)
    with pytest.raises(ValueError, match="groups of 16 or 32"):
        NativeInt8GroupWeight(native, torch.empty(64, 64), None,
                              (torch.zeros(64, 64, dtype=torch.int8), torch.ones(64, 1)))
    with pytest.raises(RuntimeError, match="int8_f32_pack_weight"):  # a float32 packing
        ops.int8_group_linear(x, ops.pack_weight(torch.zeros(64, 64)), fmt.scales, 64, None,
                              None)


def test_int8_linear_rejects_bad_input(ops):
    packed = ops.int8_pack_weight(torch.zeros(64, 32, dtype=torch.int8))
    x = torch.randn(3, 32)
    with pytest.raises(RuntimeError, match="scales"):
        ops.int8_linear(x, packed, torch.ones(64, dtype=torch.float64), 64, None, None)
    with pytest.raises(RuntimeError, match="int8_f32_pack_weight"):  # a float32 packing
        ops.int8_linear(x, ops.pack_weight(torch.zeros(64, 32)), torch.ones(64), 64,
                            None, None)
    with pytest.raises(RuntimeError, match="int8"):
        ops.int8_pack_weight(torch.zeros(64, 32))


# rows: 1 and 3 (multiplied directly), 13 and 130 (through a float32 copy of each panel)
@pytest.mark.parametrize("rows", [1, 3, 13, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 96)])
def test_int4_linear_matches_exact_arithmetic(ops, native, rows, out_features, in_features):
    """NativeInt4Weight packs; the kernel computes with the values it stands for,
    q * scale + min per group of 32 inputs."""
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=gen) / 10
    fmt = NativeInt4Weight(native, weight, torch.randn(out_features, generator=gen))
    groups = weight.view(out_features, -1, NativeInt4Weight.GROUP)
    low = groups.amin(-1, keepdim=True)
    step = (groups.amax(-1, keepdim=True) - low) / 15
    stands_for = (((groups - low) / step).round().clamp(0, 15) * step + low).view_as(weight)
    x = torch.randn(rows, 2 * in_features, generator=gen)[:, in_features:]  # strided rows
    residual = torch.randn(rows, out_features, generator=gen)
    assert_float32_sums(fmt.add(x, residual), expected(x, stands_for, fmt.bias, residual),
                        in_features)


def test_int4_linear_rejects_bad_input(ops, native):
    fmt = NativeInt4Weight(native, torch.randn(64, 64), None)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.int4_linear(x[:, :48], fmt.packed, fmt.scales, fmt.mins, 64, None, None)
    with pytest.raises(RuntimeError, match="scales and mins"):
        ops.int4_linear(x, fmt.packed, fmt.scales[:, :1], fmt.mins, 64, None, None)
    with pytest.raises(RuntimeError, match="int4 packing"):
        ops.int4_linear(x, fmt.packed.view(torch.int8), fmt.scales, fmt.mins, 64, None,
                            None)
