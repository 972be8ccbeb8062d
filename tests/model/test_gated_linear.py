"""The SiLU gate in the linear kernels' epilogue: a gated MLP's gate/up weight packed by
``WeightFormat.pack_silu_gated`` (rows interleaved in blocks of 16) gives
``silu(x @ gate.T) * (x @ up.T)`` in one call, the gate applied to the kernel's float32
sums before its one rounding; formats without such a kernel decline, and ``GatedMLP``
then gates apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.ops import layer_ops
from tokenmill.models.weights.formats import (
    NativeFormat,
    NativeInt8Format,
    NativeVnniW4A8Format,
    NativeW8A8Format,
)
from tokenmill.models.weights.native_weights import interleave_gate_up

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.fixture
def vnni(native):
    if not native.capabilities.vnni_linear:
        pytest.skip("the integer-activation kernels need a CPU with AVX512-VNNI")
    return native


@pytest.fixture
def bf16_gating(native):
    if not NativeFormat(native).gates_silu(BF16):
        pytest.skip("the bfloat16 kernel gates on a CPU with AVX512-BF16 and no AMX")
    return native


def test_interleave_gate_up_takes_16_rows_of_each_in_turn():
    weight = torch.arange(64.0)[:, None].expand(64, 3)
    rows = interleave_gate_up(weight)[:, 0].long().tolist()
    assert rows == [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]


@pytest.mark.parametrize("rows", [1, 7, 130])
@pytest.mark.parametrize("intermediate,in_features", [(48, 64), (64, 96)])
def test_bf16_gated_call_is_one_rounding_of_the_exact_gate(bf16_gating, rows, intermediate,
                                                          in_features):
    torch.manual_seed(0)
    weight = (torch.randn(2 * intermediate, in_features) * 0.2).to(BF16)
    x = torch.randn(rows, in_features).to(BF16)
    gated = NativeFormat(bf16_gating).pack_silu_gated(weight)
    out = gated(x)
    assert out.shape == (rows, intermediate) and out.dtype == BF16
    exact = silu_gate(x.double() @ weight.double().T)
    bound = exact.abs() * 2.0**-8 + in_features * 2.0**-22 * exact.abs().max()
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("format_class", [NativeW8A8Format, NativeVnniW4A8Format])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 130])
def test_vnni_gated_call_gates_the_float32_projection(vnni, format_class, dtype, rows):
    """The same quantized products as the plain call with float32 activations (which gives
    the float32 sums), gated: float32 to rounding error, bfloat16 within one rounding."""
    torch.manual_seed(1)
    intermediate, in_features = 80, 96
    weight = (torch.randn(2 * intermediate, in_features) * 0.2).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    fmt = format_class(vnni, dtype)
    sums = fmt.pack(weight, None)(x.float())
    expected = silu_gate(sums.double())
    out = fmt.pack_silu_gated(weight)(x)
    assert out.shape == (rows, intermediate) and out.dtype == dtype
    relative = 2.0**-8 if dtype == BF16 else 1e-6
    bound = expected.abs() * relative + 1e-6 * expected.abs().max()
    assert ((out.double() - expected).abs() <= bound).all()


def test_gated_calls_reject_bias_residual_and_partial_panels(vnni):
    x = torch.randn(2, 64)
    fmt = NativeW8A8Format(vnni, torch.float32)
    packed = fmt.pack(torch.randn(64, 64), None)
    op = packed.linear
    with pytest.raises(RuntimeError, match="gated call"):
        op(x, packed.packed, packed.scales, 64, None, torch.zeros(2, 64), gated=True)
    with pytest.raises(RuntimeError, match="gated call"):
        op(x, packed.packed, packed.scales, 64, torch.zeros(64), None, gated=True)
    odd = fmt.pack(torch.randn(48, 64), None)
    with pytest.raises(RuntimeError, match="gated call"):
        op(x, odd.packed, odd.scales, 48, None, None, gated=True)


def test_formats_without_a_gating_kernel_decline(native):
    weight = torch.randn(64, 32).to(BF16)
    assert NativeInt8Format(native).pack_silu_gated(weight) is None
    if native.capabilities.vnni_linear:  # an intermediate size not a multiple of 16
        assert NativeW8A8Format(native, BF16).pack_silu_gated(torch.randn(40, 32)) is None


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp_fuses_silu_only_and_computes_the_same(vnni, activation):
    """Fused or not, the MLP is the format's projection, the gate, and the format's down
    projection plus the residual."""
    torch.manual_seed(2)
    hidden, intermediate = 64, 96
    fmt = NativeW8A8Format(vnni, torch.float32)
    mlp = GatedMLP(hidden, intermediate, torch.float32, CPU, layer_ops(vnni), fmt, activation)
    gate_up = torch.randn(2 * intermediate, hidden) * 0.2
    down = torch.randn(hidden, intermediate) * 0.2
    mlp.gate_up_proj.weight.data.copy_(gate_up)
    mlp.down_proj.weight.data.copy_(down)
    mlp.gate_up_proj.pack()
    mlp.down_proj.pack()
    assert mlp.gate_up_proj.fused is (activation == "silu")
    x, residual = torch.randn(5, hidden), torch.randn(5, hidden)
    gate, up = fmt.pack(gate_up, None)(x).chunk(2, dim=-1)
    gated = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up
    expected = fmt.pack(down, None).add(gated, residual)
    torch.testing.assert_close(mlp(x, residual), expected, rtol=1e-5, atol=1e-5)
