"""The gated MLP of a decoder layer (SiLU or tanh-GELU gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers.linear import GatedLinear, Linear
from tokenmill.models.layers.ops import LayerOps
from tokenmill.models.weights.formats import WeightFormat


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``x = [gate | up]`` (Gemma's gate)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GatedMLP(nn.Module):
    """``residual + down(act(gate(x)) * up(x))`` with gate and up fused in one ``[2I, H]``
    projection (``GatedLinear``, which gates too); the gate by ``ops.silu_and_mul`` (see
    ``layers.ops``) or in the projection's kernel, or by ``gelu_tanh_and_mul`` with
    ``activation="gelu_pytorch_tanh"``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: LayerOps,
        weight_format: WeightFormat | None = None,
        activation: str = "silu",
    ):
        super().__init__()
        silu = activation == "silu"
        self.gate_up_proj = GatedLinear(hidden_size, intermediate_size, dtype, device,
                                        weight_format,
                                        ops.silu_and_mul if silu else gelu_tanh_and_mul, silu)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype, device,
                                weight_format)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_add(self.gate_up_proj(x), residual)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))``, no residual (for a norm after the MLP)."""
        return self.down_proj(self.gate_up_proj(x))
