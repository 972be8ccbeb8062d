"""Native CPU kernels of the engine, compiled on first use for the host's CPU.

``paged_decode_attention()`` returns ``torch.ops.tokenmill.paged_decode_attention`` (see
``paged_decode_attention.cpp``), building it once with the host's C++ compiler and
``ninja``, or ``None`` where it cannot be built: the caller then keeps its pure PyTorch
path. ``choose_decode_attention`` applies the engine's ``attention_backend`` option.

The build is tuned for the CPU it runs on (``-march=native``), so its cache entry is
named after the source, the compiler flags, PyTorch's version and the CPU's feature
flags: a cache shared by different hosts never hands one the other's code.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform as host_platform
from collections.abc import Callable
from pathlib import Path

import torch

from tokenmill.platform import cpu_flags
from tokenmill.sampling_params import InvalidParameterError

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("paged_decode_attention.cpp")
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")


@functools.cache
def paged_decode_attention() -> Callable | None:
    """The compiled op, or ``None`` when it cannot be built here (the reason is logged)."""
    if host_platform.system() != "Linux":
        return None
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(CFLAGS).encode(), torch.__version__.encode(),
                                     " ".join(sorted(cpu_flags())).encode()])).hexdigest()[:16]
    try:
        cpp_extension.load(name=f"tokenmill_kernels_{key}", sources=[str(SOURCE)],
                           extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("native CPU attention unavailable, using PyTorch's SDPA: %s",
                       str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None
    return torch.ops.tokenmill.paged_decode_attention


def choose_decode_attention(backend: str, device: torch.device) -> Callable | None:
    """The decode kernel for ``attention_backend`` (``auto | native | sdpa``) on ``device``:
    ``auto`` takes the native kernel on a CPU where it builds, else SDPA (``None``).
    Raises ``InvalidParameterError`` when ``native`` is asked for and cannot run."""
    if backend == "sdpa" or (backend == "auto" and device.type != "cpu"):
        return None
    if device.type != "cpu":
        raise InvalidParameterError("attention_backend native runs on the CPU only",
                                    "attention_backend")
    op = paged_decode_attention()
    if op is None and backend == "native":
        raise InvalidParameterError("the native attention kernel could not be built on this "
                                    "host (see the log); use attention_backend sdpa",
                                    "attention_backend")
    return op


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
