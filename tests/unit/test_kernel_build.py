"""The kernels' builds: each variant's flags against the CPU flags it asks of a host, the
choice among them on the three kinds of host, library names that follow the sources, and
a start that finds no library and no compiler."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.hardware import cpu_flags
from tokenmill.kernels import variants
from tokenmill.kernels.variants import HEADERS, SOURCES, VARIANTS, best_variant

# The instruction-set macros the sources test, and the /proc/cpuinfo flag of each.
MACRO_FLAGS = {"__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
               "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw",
               "__AVX512BF16__": "avx512_bf16", "__AVX512VNNI__": "avx512_vnni",
               "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16"}
ZEN3 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 abm movbe "
                 "xsave popcnt aes sha_ni".split())
ZEN4 = ZEN3 | frozenset("avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 "
                        "avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni avx512_bitalg "
                        "avx512_vpopcntdq".split())
SAPPHIRE_RAPIDS = ZEN4 | frozenset("avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8".split())


def test_the_library_name_covers_every_kernel_file() -> None:
    folder = Path(SOURCES[0]).parent
    assert set(SOURCES) == set(folder.glob("*.cpp"))
    assert set(HEADERS) == set(folder.glob("*.h"))


def test_each_host_kind_gets_the_best_variant_it_runs() -> None:
    def best(flags, machine="x86_64"):
        variant = best_variant(machine, flags)
        return variant.name if variant else None

    assert best(SAPPHIRE_RAPIDS) == "amx"
    assert best(ZEN4) == "avx512"
    assert best(ZEN3) == "avx2"
    assert best(ZEN3 - {"avx2"}) is None
    assert best(SAPPHIRE_RAPIDS, machine="aarch64") is None


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
def test_a_variants_flags_enable_only_instructions_its_hosts_have() -> None:
    """Each instruction-set macro the sources test is one the compiler defines for a variant
    only where a host it is chosen for has that instruction set."""
    tested = set()
    for path in SOURCES + HEADERS:
        tested |= set(re.findall(r"defined\((__\w+__)\)", path.read_text())) - {"__linux__"}
    assert tested <= set(MACRO_FLAGS), f"add {tested - set(MACRO_FLAGS)} to MACRO_FLAGS"
    defined = {}
    for variant in VARIANTS:
        macros = subprocess.run(["c++", "-dM", "-E", "-x", "c++", "/dev/null", *variant.march],
                                capture_output=True, text=True, check=True).stdout
        defined[variant.name] = set(re.findall(r"^#define (\w+) ", macros, re.M)) & set(MACRO_FLAGS)
        assert {MACRO_FLAGS[m] for m in defined[variant.name]} <= variant.cpu_flags
    assert defined["amx"] == set(MACRO_FLAGS)
    assert defined["avx512"] == set(MACRO_FLAGS) - {"__AMX_TILE__", "__AMX_BF16__"}
    assert defined["avx2"] == {"__AVX2__", "__FMA__", "__F16C__"}


def test_the_library_name_follows_the_sources_flags_and_torch(tmp_path, monkeypatch) -> None:
    source = tmp_path / "kernel.cpp"
    source.write_text("int one() { return 1; }\n")
    monkeypatch.setattr(variants, "SOURCES", (source,))
    monkeypatch.setattr(variants, "HEADERS", ())
    amx, avx2 = VARIANTS[0], VARIANTS[-1]
    name = amx.library_name("2.13.0")
    assert name == amx.library_name("2.13.0")
    assert name.startswith("kernels_amx_")
    assert avx2.library_name("2.13.0") != name
    assert amx.library_name("2.14.0") != name
    source.write_text("int one() { return 2; }\n")
    assert amx.library_name("2.13.0") != name


@pytest.mark.skipif(best_variant(platform.machine(), cpu_flags()) is None,
                    reason="no variant of the kernels for this CPU")
def test_a_start_without_its_library_nor_a_compiler_warns_and_goes_on(tmp_path) -> None:
    """Where neither the package nor the cache holds the variant's library and there is
    no compiler, a start says so at once and PyTorch's ops serve: it never waits."""
    start = ("import logging, pathlib, sys\n"
             "from tokenmill.kernels import build\n"
             "logging.basicConfig()\n"
             "build.KERNEL_DIR = pathlib.Path(sys.argv[1])\n"
             "print('loaded', build.load_library())\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-compiler"),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", start, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert "loaded False" in result.stdout, result.stderr[-2000:]
    assert "native CPU kernels unavailable, using PyTorch's" in result.stderr
    assert "the package holds no" in result.stderr and "no C++ compiler" in result.stderr
