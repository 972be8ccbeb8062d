"""Projections packed for PyTorch's own CPU kernels (oneDNN's, and its int8 and int4 ones).

Each class converts one plain ``[out, in]`` weight (and its bias) once and then computes
``x @ W.T + bias`` (``__call__``) and ``residual + x @ W.T + bias`` (``add``), as
``native_weights``' do.
"""

from __future__ import annotations

import functools
import os

import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.models.weights.quantize import quantize_int8_rows

# oneDNN's primitive cache and PyTorch's cache of oneDNN computations (ideep's) each keep one
# entry per (weight shape, row count) a projection meets, about 0.2 to 0.6 MiB apiece; at
# their default of 1024 entries, a server whose batches keep taking new sizes grows by up to
# about 1 GiB, and faster when slow steps make larger, more varied batches. Bounded here,
# before the first oneDNN call (both read the variable then); a value the user set wins.
ONEDNN_CACHE_ENTRIES = "256"
for _variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_variable, ONEDNN_CACHE_ENTRIES)


class OneDNNWeight:
    """oneDNN's blocked layout (float32, bfloat16 or float16): one product and sum per
    output in the dtype, as ``F.linear``.

    Invariant: a row's result does not depend on how many rows the call has (tested for
    decode and verify sizes), so a token gets the same bits alone or in a batch. oneDNN's
    float32 and float16 single-row path (a GEMV) sums in another order than its multi-row
    one, so there a single row is computed as the first of two; its bfloat16 paths agree."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # tuned for batch 1
        self.bias = bias
        self.pad_single_row = weight.dtype != torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_single_row and x.shape[0] == 1:
            return self(x.expand(2, -1))[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """One oneDNN call, one rounding of the sum."""
        if self.pad_single_row and x.shape[0] == 1:
            return self.add(x.expand(2, -1), residual.expand(2, -1))[:1]
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias,
                                                         "add")


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder (and so multiply) ``dtype`` weights on this CPU: tried
    once on a small weight, since the answer depends on the instruction set (its bfloat16
    reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        OneDNNWeight(torch.zeros(16, 16, dtype=dtype), None)(torch.zeros(1, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


class Int8Weight:
    """int8 weights, one scale per output row (symmetric); activations in the dtype of the
    weight it is made from (bfloat16 or float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, scales = quantize_int8_rows(weight)
        self.scales = scales.to(weight.dtype)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return out if self.bias is None else out.add_(self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self(x).add_(residual)


class Int4Weight:
    """4-bit weights, asymmetric, one scale and zero per ``GROUP`` inputs of a row;
    activations, scales and zeros in the dtype of the weight it is made from (bfloat16 or
    float32). Needs ``in % GROUP == 0`` and ``out % 16 == 0`` (the kernel's packing)."""

    GROUP = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_features, in_features = weight.shape
        if in_features % self.GROUP or out_features % 16:
            raise InvalidParameterError(
                f"--quantization int4 needs projections of a multiple of {self.GROUP} inputs "
                f"and 16 outputs, this model has {in_features} -> {out_features}: use int8",
                "quantization")
        groups = weight.float().view(out_features, in_features // self.GROUP, self.GROUP)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        # The kernel computes (q - 8) * scale + zero with scale and zero in the dtype: round
        # them first, then pick each q against the rounded pair, so the rounding of a zero
        # far from 0 (a group of weights all of one sign) is made up for by q where it can.
        dtype = weight.dtype
        scales = ((high - low) / 15).clamp_min(torch.finfo(dtype).tiny).to(dtype).float()
        zeros = (low + 8 * scales).to(dtype).float()
        values = ((groups - zeros) / scales + 8).round_().clamp_(0, 15).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            values.view(out_features, in_features), 2)
        self.scales_and_zeros = torch.stack(
            (scales.view(out_features, -1).t(), zeros.view(out_features, -1).t()),
            dim=-1).contiguous().to(dtype)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.GROUP,
                                                         self.scales_and_zeros)
        return out if self.bias is None else out.add_(self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self(x).add_(residual)
