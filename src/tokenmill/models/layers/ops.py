"""The row-wise ops of a decoder layer, PyTorch's or the native kernels', chosen once.

``layer_ops(kernels)`` is handed to every ``RMSNorm`` and ``GatedMLP`` when the model is
built; each binds the op it calls then, so a forward pass calls it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.kernels import NativeKernels
from tokenmill.kernels.signatures import RmsNorm, SiluAndMul


@dataclass(frozen=True, slots=True)
class LayerOps:
    rms_norm: RmsNorm
    silu_and_mul: SiluAndMul


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def _torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


TORCH_LAYER_OPS = LayerOps(rms_norm=_torch_rms_norm, silu_and_mul=_torch_silu_and_mul)


def layer_ops(kernels: NativeKernels | None) -> LayerOps:
    """The native kernels' ops where the engine has them (one pass over a row, float32
    inside, one rounding), else PyTorch's (several ops, in the dtype)."""
    if kernels is None:
        return TORCH_LAYER_OPS
    return LayerOps(rms_norm=kernels.rms_norm, silu_and_mul=kernels.silu_and_mul)
