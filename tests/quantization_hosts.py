"""Which quantizations a host runs, read from the native kernels' capabilities alone: the
instruction sets each one's kernels need, written here apart from the table of
quantizations (``models.weights.quantizations``). An exactness test skips only where this
check, made before it builds anything, says the host cannot run an option; where it can, a
refusal is a failure."""

from __future__ import annotations

import torch

from tokenmill.hardware import pick_device
from tokenmill.kernels import KernelCapabilities, choose_kernels

CPU = torch.device("cpu")


def runs_here(quantization: str, dtype: torch.dtype, capabilities: KernelCapabilities | None,
              device: torch.device = CPU) -> bool:
    """Whether ``quantization`` computes in ``dtype`` on ``device`` (``capabilities``: the
    native kernels', None without them): none anywhere; on the CPU int8 and int4 in
    bfloat16 or float32 (PyTorch's kernels where there are no native ones), w8a8 with
    AVX512-VNNI, w4a8 with AVX512-VNNI or, in float32, with AVX2, FMA and F16C."""
    if quantization == "none":
        return True
    if device.type != "cpu":
        return False
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


def gguf_integer_here(capabilities: KernelCapabilities | None) -> bool:
    """Whether ``--quantization gguf`` computes a file's Q4_0, Q4_1, Q4_K, Q6_K and Q8_0
    rows on their blocks times activations quantized to int8 (the VNNI kernels; bfloat16
    or float32 activations alike): with AVX512-VNNI. Elsewhere the rows take the weight-only
    int8 and int4 kernels."""
    return capabilities is not None and capabilities.vnni_linear


def gguf_dense_rows_here(capabilities: KernelCapabilities | None) -> bool:
    """Whether the VNNI kinds (``gguf_integer_here``) take calls of bfloat16 activations
    from ``DenseAtRowsWeight.DENSE_ROWS`` rows on oneDNN's bfloat16 matmul over their
    dequantized weight: with AMX tiles too."""
    return gguf_integer_here(capabilities) and capabilities.amx


def batch_invariant_here(dtype: torch.dtype, capabilities: KernelCapabilities | None,
                         device: torch.device = CPU) -> bool:
    """Whether ``batch_invariant`` (native linear kernels only) runs in ``dtype`` on
    ``device``: on the CPU, bfloat16 with AVX512-BF16, float32 with AVX2 and FMA
    (``KernelCapabilities.linear``)."""
    return device.type == "cpu" and capabilities is not None and capabilities.linear(dtype)


def host() -> tuple[torch.device, KernelCapabilities | None]:
    """The device an engine with ``device="auto"`` runs on, and the native kernels'
    capabilities there (None where it computes with PyTorch's)."""
    device = pick_device()
    kernels = choose_kernels("auto", device)
    return device, None if kernels is None else kernels.capabilities
