"""How a projection's weight is stored for the kernels that multiply by it.

After loading, ``choose_weight_format(dtype, device, quantization)`` names the fastest
exact-enough form this host supports, and every ``Linear`` (and the tied output head)
converts its plain ``[out, in]`` weight into it once:

- ``OneDNNWeight``: oneDNN's blocked layout, for the CPU in float32, bfloat16 or float16.
  Same arithmetic as ``F.linear`` (one product and sum per output, in the dtype), about
  twice as fast for the small batches of decoding. Only where oneDNN can reorder the
  dtype on this CPU: its bfloat16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, so an
  AVX2-only host keeps bfloat16 weights plain (``onednn_supports`` probes it).
- ``Int8Weight``: ``--quantization int8``, CPU, bfloat16 activations. Weights are int8
  with one scale per output row (symmetric), expanded to bfloat16 inside the kernel
  (weight-only: a quarter of float32's bytes to read per decode step). Activations stay
  in floating point because quantizing them too (dynamic int8, per tensor or per row)
  raised the embedded model's perplexity by 5 to 12%; weight-only int8 costs 0.2%.
- ``None``: plain ``F.linear`` (CUDA, or no packed form for this dtype here).

Every format computes ``x @ W.T + bias`` (``__call__``) and ``residual + x @ W.T + bias``
(``add``); oneDNN fuses the add into the product.
"""

from __future__ import annotations

import functools

import torch

from tokenmill.sampling_params import InvalidParameterError


class OneDNNWeight:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # tuned for batch 1
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """One oneDNN call, one rounding of the sum."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias,
                                                         "add")


class Int8Weight:
    """int8 weights, one scale per output row (symmetric), bfloat16 activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        self.weight = (weight / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        self.scales = scales.to(torch.bfloat16)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return out if self.bias is None else out.add_(self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self(x).add_(residual)


WeightFormat = type[OneDNNWeight] | type[Int8Weight]


def choose_weight_format(dtype: torch.dtype, device: torch.device,
                         quantization: str = "none") -> WeightFormat | None:
    """The format every projection takes after loading; None keeps plain weights.

    Raises ``InvalidParameterError`` for a quantization this device or dtype cannot run.
    """
    if quantization == "int8":
        if device.type != "cpu":
            raise InvalidParameterError("--quantization int8 runs on the CPU only",
                                        "quantization")
        if dtype != torch.bfloat16:
            raise InvalidParameterError(
                "--quantization int8 computes in bfloat16: use --dtype auto or bfloat16",
                "quantization")
        return Int8Weight
    assert quantization == "none", "EngineConfig validates the name"
    if device.type == "cpu" and onednn_supports(dtype):
        return OneDNNWeight
    return None


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder (and so multiply) ``dtype`` weights on this CPU: tried
    once on a small weight, since the answer depends on the instruction set."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        OneDNNWeight(torch.zeros(16, 16, dtype=dtype), None)(torch.zeros(1, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True
