"""The builds of the native CPU kernels: one shared library per instruction-set variant.

The ``.cpp`` files compile each kernel under an ``#if`` on the instructions it is written
in (``__AVX2__``, ``__AVX512BF16__``, ``__AMX_TILE__`` ...), so what a build holds follows
from the compiler flags it was built with. The package is built with every variant in
``VARIANTS`` (``setup.py``); at start a process loads the best variant whose CPU flags the
host has. A library is named after everything it was built from (the sources, the flags,
PyTorch's version and the Python ABI): a library whose name matches the sources on disk
is never stale, and an edit to a ``.cpp`` or ``.h`` changes the name to look for.

This module imports nothing outside the standard library: ``setup.py`` loads it by path,
before the package (or its dependencies) can be imported.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).parent
SOURCES = tuple(KERNEL_DIR / name
                for name in ("paged_decode_attention.cpp", "paged_prefill_attention.cpp",
                             "fused_layers.cpp", "bf16_linear.cpp", "f32_linear.cpp",
                             "w4a8_linear.cpp", "vnni_linear.cpp", "decode_layers.cpp",
                             "argmax_rows.cpp", "sample_rows.cpp",
                             "logprob_rows.cpp", "kv_int8_blocks.cpp"))
HEADERS = tuple(KERNEL_DIR / name
                for name in ("dtype_conversion.h", "avx2_lanes.h", "avx512_lanes.h",
                             "linear_epilogue.h", "amx_tiles.h", "w4a8_groups.h",
                             "thread_batches.h", "kv_int8_rows.h"))
# Fast math: vectorized exp and reassociated sums. (The bfloat16 rounding tests NaN on the
# bits, so a NaN still comes out a NaN.) -g0 undoes the -g of Python's own flags, which
# setuptools adds: debug information doubles the compile time and the library's size.
CFLAGS = ("-O3", "-ffast-math", "-fopenmp", "-g0")
LDFLAGS = ("-fopenmp",)
LIBRARY_PREFIX = "kernels_"

_X86_64_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave"})
_X86_64_V4 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
_AVX512_INT8_BF16 = frozenset({"avx512_bf16", "avx512_vnni"})


@dataclass(frozen=True)
class Variant:
    """Invariant: ``march`` makes the compiler emit only instructions named in
    ``cpu_flags`` (as ``/proc/cpuinfo`` spells them), so a host with all of them runs
    the library."""

    name: str
    march: tuple[str, ...]
    cpu_flags: frozenset[str]

    def runs_on(self, host_flags: frozenset[str]) -> bool:
        return self.cpu_flags <= host_flags

    def library_name(self, torch_version: str) -> str:
        """The library's name (no suffix) for the sources on disk and ``torch_version``."""
        digest = hashlib.sha256()
        for part in (self.name, " ".join(CFLAGS + self.march + LDFLAGS), torch_version,
                     sys.implementation.cache_tag):
            digest.update(part.encode() + b"\0")
        for path in sorted(SOURCES + HEADERS):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return f"{LIBRARY_PREFIX}{self.name}_{digest.hexdigest()[:16]}"


# Best first. AVX-VNNI (the VEX form of VPDPBUSD, Zen 5 and Intel's hybrids) is left out:
# no kernel is written in it, and Zen 4 lacks it.
VARIANTS = (
    Variant("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile",
                    "-mamx-int8", "-mamx-bf16"),
            _X86_64_V3 | _X86_64_V4 | _AVX512_INT8_BF16 | {"amx_tile", "amx_int8", "amx_bf16"}),
    Variant("avx512", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
            _X86_64_V3 | _X86_64_V4 | _AVX512_INT8_BF16),
    Variant("avx2", ("-march=x86-64-v3",), _X86_64_V3),
)


def variants_for(machine: str) -> tuple[Variant, ...]:
    """The variants built for ``machine`` (``platform.machine()``): none but on x86-64."""
    return VARIANTS if machine.lower() in ("x86_64", "amd64") else ()


def best_variant(machine: str, host_flags: frozenset[str]) -> Variant | None:
    """The first of ``variants_for(machine)`` the host runs; None where it runs none."""
    return next((v for v in variants_for(machine) if v.runs_on(host_flags)), None)
