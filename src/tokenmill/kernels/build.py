"""Compile the ``.cpp`` files of this package once for the host's CPU, or load that build.

``load_library()`` registers the kernels as ``torch.ops.tokenmill`` ops. The build is
tuned for the CPU it runs on (``-march=native``), so its cache entry is named after the
sources, the compiler flags, PyTorch's version and the CPU's feature flags: a cache
shared by different hosts never hands one the other's code. A finished build is loaded
directly, silently; only a missing one goes through PyTorch's builder (which locks its
folder while it compiles), between two log lines, since it takes a while.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform as host_platform
import time
from pathlib import Path

import torch

from tokenmill.hardware import cpu_flags

logger = logging.getLogger("tokenmill")
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("paged_decode_attention.cpp", "paged_prefill_attention.cpp",
                             "fused_layers.cpp", "bf16_linear.cpp", "f32_linear.cpp",
                             "w4a8_linear.cpp", "vnni_linear.cpp", "decode_layers.cpp",
                             "argmax_rows.cpp", "sample_rows.cpp",
                             "logprob_rows.cpp", "kv_int8_blocks.cpp"))
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("dtype_conversion.h", "avx2_lanes.h", "avx512_lanes.h",
                             "linear_epilogue.h", "amx_tiles.h", "w4a8_groups.h",
                             "thread_batches.h", "kv_int8_rows.h"))
# Fast math: vectorized exp and reassociated sums. (The bfloat16 rounding tests NaN on the
# bits, so a NaN still comes out a NaN.)
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")


@functools.cache
def load_library() -> bool:
    """Whether ``torch.ops.tokenmill`` holds the kernels: False where they cannot be built
    here (not Linux, no compiler; the reason is logged)."""
    if host_platform.system() != "Linux":
        return False
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
            logger.info("compiling the native CPU kernels for this CPU, once (later starts "
                        "load the build): about a minute on 2 cores")
            start = time.monotonic()
            os.makedirs(build_dir, exist_ok=True)
            cpp_extension.load(name=name, sources=[str(s) for s in SOURCES],
                               extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                               build_directory=build_dir, is_python_module=False,
                               verbose=False)
            logger.info("native CPU kernels compiled in %.0f s", time.monotonic() - start)
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("native CPU kernels unavailable, using PyTorch's: %s",
                       str(error).splitlines()[0] if str(error) else type(error).__name__)
        return False
    return True


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
