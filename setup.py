"""Builds the native CPU kernels into the package, one shared library per instruction-set
variant (``src/tokenmill/kernels/variants.py``), with PyTorch's C++ extension support.

``TOKENMILL_KERNEL_VARIANTS`` picks the variants: ``all`` (the default), a comma-separated
list of their names, or ``none`` (no compiler needed; tokenmill then uses PyTorch's ops
and says so at start). ``MAX_JOBS``
caps the parallel compiles. Everything else is in ``pyproject.toml``.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import setup

KERNELS = Path("src/tokenmill/kernels")
NO_COMPILER = """
tokenmill compiles its native CPU kernels when it is installed, and found no C++ compiler
({compiler!r}; the CXX variable names another). Install one (Debian and Ubuntu:
apt-get install g++) and run the install again, or install without the kernels:
TOKENMILL_KERNEL_VARIANTS=none pip install ... (tokenmill then uses PyTorch's slower ops
and says so at start).
"""


def _variants_module():
    spec = importlib.util.spec_from_file_location("tokenmill_kernel_variants",
                                                  KERNELS / "variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _chosen(variants, choice: str) -> list:
    if platform.system() != "Linux":
        return []
    offered = variants.variants_for(platform.machine())
    if choice == "all":
        return list(offered)
    names = {name.strip() for name in choice.split(",") if name.strip()} - {"none"}
    unknown = names - {v.name for v in offered}
    if unknown:
        sys.exit(f"TOKENMILL_KERNEL_VARIANTS: unknown variant(s) {', '.join(sorted(unknown))} "
                 f"(choose from: all, none, {', '.join(v.name for v in offered)})")
    return [v for v in offered if v.name in names]


def _extensions() -> tuple[list, dict]:
    variants = _variants_module()
    chosen = _chosen(variants, os.environ.get("TOKENMILL_KERNEL_VARIANTS", "all").strip())
    if not chosen:
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class BuildKernels(BuildExtension):
        """Fails with a clear message where there is no compiler; compiles each variant in
        its own folder (the same sources with other flags); drops an edited checkout's
        libraries of earlier sources."""

        def run(self) -> None:
            compiler = os.environ.get("CXX", "c++")
            if shutil.which(compiler) is None:
                sys.exit(NO_COMPILER.format(compiler=compiler))
            super().run()

        def build_extension(self, ext) -> None:
            build_temp = self.build_temp
            self.build_temp = os.path.join(build_temp, ext.variant)
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = build_temp

        def copy_extensions_to_source(self) -> None:
            for stale in KERNELS.glob(f"{variants.LIBRARY_PREFIX}*.so"):
                stale.unlink()
            super().copy_extensions_to_source()

    extensions = []
    for variant in chosen:
        name = variant.library_name(torch.__version__)
        extension = CppExtension(
            name=f"tokenmill.kernels.{name}",
            sources=[os.path.relpath(source) for source in variants.SOURCES],
            extra_compile_args=[*variants.CFLAGS, *variant.march],
            extra_link_args=list(variants.LDFLAGS))
        extension.variant = variant.name
        extensions.append(extension)
    return extensions, {"build_ext": BuildKernels}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
