"""Load the native CPU kernels' library for this CPU: the one the package was built with,
or, where the sources changed since (an edited checkout), one compiled here once.

``load_library()`` registers the kernels as ``torch.ops.tokenmill`` ops. It takes the best
variant this CPU runs (``variants.py``) and looks for that variant's library built from the
sources on disk: first in the package, then in the cache folder (``tokenmill/`` under
``TORCH_EXTENSIONS_DIR``, by default PyTorch's extensions folder). Only where neither holds
it does it compile, between two log lines; where it cannot (no compiler), it says why and
PyTorch's ops serve.

Invariant: nothing a killed process leaves in the cache stops the next one. A library
appears there only complete (compiled in a folder of its own, then renamed into place);
one process compiles at a time, under an ``flock`` lock the kernel releases when its
holder dies, however it dies; and a compile folder left by a killed process is removed by
the next compile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform as host_platform
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from tokenmill.hardware import cpu_flags
from tokenmill.kernels.variants import (
    CFLAGS,
    KERNEL_DIR,
    LDFLAGS,
    LIBRARY_PREFIX,
    SOURCES,
    Variant,
    best_variant,
)

logger = logging.getLogger("tokenmill")
_COMPILING = ".compiling-"


@functools.cache
def load_library() -> bool:
    """Whether ``torch.ops.tokenmill`` holds the kernels: False where they cannot be loaded
    here (not Linux, a CPU without AVX2, sources changed and no compiler; the reason is
    logged)."""
    if host_platform.system() != "Linux":
        return False
    variant = best_variant(host_platform.machine(), cpu_flags())
    if variant is None:
        logger.warning("native CPU kernels unavailable, using PyTorch's: they are built for "
                       "x86-64 CPUs with AVX2 and FMA, and this one is not")
        return False
    name = variant.library_name(torch.__version__)
    installed = KERNEL_DIR / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    try:
        if installed.exists():
            torch.ops.load_library(str(installed))
            return True
        return _load_or_compile_for(variant, name)
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("native CPU kernels unavailable, using PyTorch's: %s",
                       str(error).splitlines()[0] if str(error) else type(error).__name__)
        return False


def _load_or_compile_for(variant: Variant, name: str) -> bool:
    if any(KERNEL_DIR.glob(f"{LIBRARY_PREFIX}{variant.name}_*")):
        why = f"the kernel sources changed since the package's {variant.name} build"
    else:
        why = f"the package holds no {variant.name} build of the kernels"
    compiler = os.environ.get("CXX", "c++")
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or _default_cache_root()) / "tokenmill"
    if not (root / f"{name}.so").exists() and shutil.which(compiler) is None:
        logger.warning("native CPU kernels unavailable, using PyTorch's: %s, and there is no "
                       "C++ compiler (%s) to build them", why, compiler)
        return False
    load_or_compile(name, SOURCES, CFLAGS + variant.march, LDFLAGS, root,
                    why=f"{why}; about two minutes on 2 cores")
    return True


def load_or_compile(name: str, sources: Sequence[Path], cflags: Sequence[str],
                    ldflags: Sequence[str], root: Path, why: str) -> None:
    """Load ``root/<name>.so``, compiling it from ``sources`` first where it is missing
    (``why`` says why in the log). Raises what the compiler or the loader raise."""
    library = root / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return
    root.mkdir(parents=True, exist_ok=True)
    with _compile_lock(root):
        if library.exists():  # another process compiled it while this one waited
            torch.ops.load_library(str(library))
            return
        for left in root.glob(f"*{_COMPILING}*"):
            shutil.rmtree(left, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(prefix=f"{name}{_COMPILING}", dir=root))
        logger.info("compiling the native CPU kernels (%s), once: %s", name, why)
        start = time.monotonic()
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        try:
            # Loads the library from the folder, which is then renamed into place (the
            # loaded file stays the same file).
            cpp_extension.load(name=name, sources=[str(s) for s in sources],
                               extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                               build_directory=str(folder), is_python_module=False,
                               verbose=False)
            os.replace(folder / f"{name}.so", library)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        logger.info("native CPU kernels compiled in %.0f s", time.monotonic() - start)


@contextlib.contextmanager
def _compile_lock(root: Path) -> Iterator[None]:
    """Held by one process at a time; ``flock`` ties it to the open file, which the kernel
    closes when the process ends, so a killed holder never leaves it held. (The file is
    opened close-on-exec: a compiler the holder started does not hold it.)"""
    import fcntl  # POSIX only; on other systems nothing gets this far

    with open(root / "kernels.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process compiling the native CPU kernels")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _default_cache_root() -> str:
    from torch.utils import cpp_extension

    return cpp_extension.get_default_build_root()


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
