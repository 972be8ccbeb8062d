"""Native CPU kernels of the engine, built with the package in a variant per kind of CPU.

The one door to them::

    kernels = choose_kernels("auto", device)   # NativeKernels, or None: PyTorch's ops
    kernels.capabilities                        # KernelCapabilities: what this CPU and
                                                # build can do; choices ask it, never the ops
    kernels.rms_norm(x, weight, eps)            # the ops every build has, bound once
    kernels.prefill_attention(dtype, head_dim)  # a CPU-dependent one, where capable
    kernels.linear_kernels(dtype)               # the linear ops for dtype, where capable
    kernels.decode_layers(eps, heads, ...)      # a decoder stack's step in one call

``build`` loads the host's variant (``variants``: what each is built for), ``capabilities``
records what the build holds, ``signatures`` types the ops (``models.weights`` packs
projections for the linear kernels: ``native_weights``). The bfloat16
kernels (linear layers, prefill attention) exist only on a CPU with AVX512-BF16 (where it
has AMX, the linear layers multiply on its tiles: ``capabilities.linear_tiles``), the
float32 linear layers on any with AVX2 and FMA, the float32 w4a8
linear layer on any with AVX2, FMA and F16C, the integer-activation linear layers (w8a8,
w4a8; bfloat16 or float32) on one with AVX512-VNNI.
"""

from tokenmill.kernels.capabilities import KernelCapabilities
from tokenmill.kernels.native import (
    KernelUnavailableError,
    LinearKernels,
    NativeKernels,
    choose_kernels,
    native_kernels,
)

__all__ = [
    "KernelCapabilities",
    "KernelUnavailableError",
    "LinearKernels",
    "NativeKernels",
    "choose_kernels",
    "native_kernels",
]
