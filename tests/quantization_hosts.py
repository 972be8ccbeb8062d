"""Which quantizations a host runs, read from the native kernels' capabilities alone: the
instruction sets each one's kernels need, written here apart from the table of
quantizations (``models.weights.quantizations``). An exactness test skips only where this
check, made before it builds anything, says the host cannot run an option; where it can, a
refusal is a failure."""

from __future__ import annotations

import torch

from tokenmill.kernels import KernelCapabilities


def runs_here(quantization: str, dtype: torch.dtype,
              capabilities: KernelCapabilities | None) -> bool:
    """Whether ``quantization`` computes in ``dtype`` on this CPU (``capabilities``: the
    native kernels', None without them): none, int8 and int4 everywhere (PyTorch's kernels
    where there are no native ones), w8a8 with AVX512-VNNI, w4a8 with AVX512-VNNI or, in
    float32, with AVX2, FMA and F16C."""
    if quantization == "none":
        return True
    if quantization in ("int8", "int4"):
        return dtype in (torch.bfloat16, torch.float32)
    if capabilities is None:
        return False
    vnni = capabilities.vnni_linear and dtype in (torch.bfloat16, torch.float32)
    if quantization == "w8a8":
        return vnni
    if quantization == "w4a8":
        return vnni or (dtype == torch.float32 and capabilities.w4a8_linear)
    raise ValueError(f"no host check for quantization {quantization!r}")


def batch_invariant_here(dtype: torch.dtype, capabilities: KernelCapabilities | None) -> bool:
    """Whether ``batch_invariant`` (native linear kernels only) runs in ``dtype`` here:
    bfloat16 with AVX512-BF16, float32 with AVX2 and FMA (``KernelCapabilities.linear``)."""
    return capabilities is not None and capabilities.linear(dtype)
