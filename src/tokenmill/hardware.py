"""Device and dtype choice.

``device_dtype("auto", device)`` picks bfloat16 where the hardware computes it natively
(any CUDA device; a CPU with AMX or AVX512-BF16) and float32 elsewhere, where bfloat16
would be emulated and slower than float32 (a quantization may take another: its row of
``models.weights.quantizations`` says).
"""

from __future__ import annotations

import functools

import torch

from tokenmill.errors import InvalidParameterError

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_CHOICES = ("auto", *DTYPES)
_CPU_BF16_FLAGS = {"amx_bf16", "avx512_bf16"}


def pick_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def device_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto" | "float32" | "bfloat16" | "float16"`` -> the torch dtype to run in on
    ``device``."""
    if name == "auto":
        native_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16())
        return torch.bfloat16 if native_bf16 else torch.float32
    dtype = DTYPES.get(name)
    if dtype is None:
        raise InvalidParameterError(
            f"unknown dtype {name!r} (choose one of: {', '.join(DTYPE_CHOICES)})", param="dtype"
        )
    return dtype


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AMX-BF16 or AVX512-BF16)."""
    flags = cpu_flags()
    if flags:
        return bool(_CPU_BF16_FLAGS & flags)
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_has_avx512_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI (the integer-activation kernels' VPDPBUSD; they are
    built on Linux only, where ``/proc/cpuinfo`` says)."""
    return "avx512_vnni" in cpu_flags()


def cpu_has_avx512f() -> bool:
    """Whether this CPU has AVX-512F (the native kernels are built on Linux only, where
    ``/proc/cpuinfo`` says)."""
    return "avx512f" in cpu_flags()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX-BF16 tiles (oneDNN's fastest bfloat16 matrix products)."""
    flags = cpu_flags()
    return "amx_bf16" in flags if flags else torch.cpu._is_amx_tile_supported()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo``; empty where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
