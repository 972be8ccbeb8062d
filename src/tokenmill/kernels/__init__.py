"""Native CPU kernels of the engine, compiled on first use for the host's CPU.

``native_ops()`` builds the ``.cpp`` files here once with the host's C++ compiler and
``ninja`` and returns their ``torch.ops.tokenmill`` ops as a ``NativeOps``, or ``None``
where they cannot be built: the model then keeps its pure PyTorch path. The bfloat16 ops
(linear layers, prefill attention) exist only on a CPU with AVX512-BF16, the float32
linear layers only on one with AVX2 and FMA but no AVX-512, the w4a8 linear layer on any
with AVX2, FMA and F16C; elsewhere their fields are None. ``choose_kernels`` applies the
engine's ``kernels`` option.

The build is tuned for the CPU it runs on (``-march=native``), so its cache entry is
named after the sources, the compiler flags, PyTorch's version and the CPU's feature
flags: a cache shared by different hosts never hands one the other's code. A finished
build is loaded directly; only a missing one goes through PyTorch's builder (which
locks its folder while it compiles).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform as host_platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.hardware import cpu_flags

logger = logging.getLogger(__name__)
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("paged_decode_attention.cpp", "paged_prefill_attention.cpp",
                             "fused_layers.cpp", "bf16_linear.cpp", "f32_linear.cpp",
                             "w4a8_linear.cpp", "argmax_rows.cpp", "sample_rows.cpp"))
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("dtype_conversion.h", "avx2_lanes.h", "linear_epilogue.h"))
# Fast math: vectorized exp and reassociated sums. (The bfloat16 rounding tests NaN on the
# bits, so a NaN still comes out a NaN.)
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")


@dataclass(frozen=True, slots=True)
class NativeOps:
    """The compiled ops (signatures in the ``.cpp`` files)."""

    paged_decode_attention: Callable
    rms_norm: Callable
    silu_and_mul: Callable
    rotary_store_kv: Callable
    argmax_rows: Callable
    sample_rows: Callable
    # bfloat16 activations only, None where the CPU lacks AVX512-BF16: linear layers over
    # bfloat16, int8 or int4 weights in bf16_pack_weight's / int8_pack_weight's /
    # weight_formats.NativeInt4Weight's layout; causal prefill attention (head size 64 or 128)
    bf16_pack_weight: Callable | None
    bf16_linear: Callable | None
    int8_pack_weight: Callable | None
    int8_linear: Callable | None
    int4_linear: Callable | None
    paged_prefill_attention: Callable | None
    # float32 activations, None unless the CPU has AVX2 and FMA but no AVX-512F: linear
    # layers over float32, int8 or int4 weights in f32_pack_weight's /
    # int8_f32_pack_weight's / weight_formats.NativeInt4Weight's layout
    f32_pack_weight: Callable | None
    f32_linear: Callable | None
    int8_f32_pack_weight: Callable | None
    int8_f32_linear: Callable | None
    int4_f32_linear: Callable | None
    # float32 activations quantized to int8 at every call, None unless the CPU has AVX2,
    # FMA and F16C: linear layers over 4-bit weights in weight_formats.NativeW4A8Weight's
    # layout
    w4a8_linear: Callable | None


@functools.cache
def native_ops() -> NativeOps | None:
    """The compiled ops, or ``None`` when they cannot be built here (the reason is logged)."""
    if host_platform.system() != "Linux":
        return None
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    parts = [source.read_bytes() for source in SOURCES + HEADERS]
    parts += [" ".join(CFLAGS).encode(), torch.__version__.encode(),
              " ".join(sorted(cpu_flags())).encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    name = f"tokenmill_kernels_{digest}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = os.path.join(root, name)
    library = os.path.join(build_dir, f"{name}.so")
    try:
        if os.path.exists(library):
            torch.ops.load_library(library)
        else:
            os.makedirs(build_dir, exist_ok=True)
            cpp_extension.load(name=name, sources=[str(s) for s in SOURCES],
                               extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                               build_directory=build_dir, is_python_module=False,
                               verbose=False)
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("native CPU kernels unavailable, using PyTorch's: %s",
                       str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None
    ops = torch.ops.tokenmill
    bf16 = {name: getattr(ops, name) if hasattr(ops, "bf16_linear") else None
            for name in ("bf16_pack_weight", "bf16_linear", "int8_pack_weight", "int8_linear",
                         "int4_linear", "paged_prefill_attention")}
    f32 = {name: getattr(ops, name) if hasattr(ops, "f32_linear") else None
           for name in ("f32_pack_weight", "f32_linear", "int8_f32_pack_weight",
                        "int8_f32_linear", "int4_f32_linear")}
    w4a8 = ops.w4a8_linear if hasattr(ops, "w4a8_linear") else None
    return NativeOps(ops.paged_decode_attention, ops.rms_norm, ops.silu_and_mul,
                     ops.rotary_store_kv, ops.argmax_rows, ops.sample_rows, **bf16, **f32,
                     w4a8_linear=w4a8)


def choose_kernels(choice: str, device: torch.device) -> NativeOps | None:
    """The native ops for the ``kernels`` option (``auto | native | torch``) on ``device``:
    ``auto`` takes them on a CPU where they build, else PyTorch's (``None``).
    Raises ``InvalidParameterError`` when ``native`` is asked for and cannot run."""
    if choice == "torch" or (choice == "auto" and device.type != "cpu"):
        return None
    if device.type != "cpu":
        raise InvalidParameterError("kernels native runs on the CPU only", "kernels")
    ops = native_ops()
    if ops is None and choice == "native":
        raise InvalidParameterError("the native kernels could not be built on this host (see "
                                    "the log); use kernels torch", "kernels")
    return ops


def _put_ninja_on_path() -> None:
    """PyTorch's builder runs ``ninja`` from ``PATH``; the ``ninja`` package's binary sits
    in this environment's scripts folder, which is not on ``PATH`` unless it is activated."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
