"""The table of quantizations: one row per ``--quantization`` choice, saying what it packs,
in which weight formats (each names its kernel, and the hosts and dtypes it runs on: its
``supports``), what ``--dtype auto`` computes it in, and whether it needs a GGUF file.

This is the only place a quantization is decided:

- ``choose_weight_format(dtype, device, quantization, kernels)``: the format every
  projection takes (the row's first format this host runs), or the refusal;
- ``resolve_quantization(name, path, ...)``: the row ``--quantization`` takes for a model
  (``auto``: ``gguf`` for a GGUF file of quantized weights where it runs, else ``none``);
- ``resolve_dtype(name, device, quantization)``: ``--dtype`` for the row (``auto``: the
  row's own dtype where it has one, else the device's, ``hardware.device_dtype``);
- ``check_source(quantization, path)``: whether a model folder or file can give the row
  its weights (the GGUF rows compute on a file's own blocks).

Adding a quantization is one row here, its name in ``quantization_names``, and its format
class (``formats``) over its packed-weight class.

Every packed format computes each row of a call alone at a decode or verify step's sizes
(tested), so a token gets the same bits alone, in a batch or among speculative drafts.
Only the native formats promise it at every size (a prefill's too): ``batch_invariant``
takes them alone, and raises where the host has none for the dtype.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.hardware import cpu_has_avx512_vnni, device_dtype
from tokenmill.kernels import NativeKernels
from tokenmill.models.gguf.loader import holds_quantized_matrices
from tokenmill.models.weights.formats import (
    GGUFFormat,
    Int4Format,
    Int8Format,
    KernelWeightFormat,
    LlamaCppFormat,
    NativeFormat,
    NativeInt4Format,
    NativeInt8Format,
    NativeVnniW4A8Format,
    NativeW4A8Format,
    NativeW8A8Format,
    OneDNNFormat,
    WeightFormat,
)
from tokenmill.quantization_names import QUANTIZATION_CHOICES


def _float32_without_vnni(device: torch.device) -> torch.dtype | None:
    """float32 on a CPU without AVX512-VNNI (the w4a8 kernel there takes float32 only)."""
    return torch.float32 if device.type == "cpu" and not cpu_has_avx512_vnni() else None


@dataclass(frozen=True, slots=True)
class Quantization:
    """A row of ``QUANTIZATIONS``. Invariant: a model takes the first of ``formats`` whose
    ``supports`` holds for its dtype and kernels (on the CPU; ``none`` alone runs off it),
    and a refusal names what the row needs where none does."""

    name: str
    packs: str
    """What a projection stores and computes with (``docs/performance.md`` has the speeds
    and accuracy costs)."""
    formats: tuple[type[WeightFormat], ...]
    """Its formats, fastest first; each names its packed-weight class and kernel."""
    needs: str
    """The hosts its formats run on, for a refusal."""
    instead: str
    """The quantization a refusal suggests."""
    auto_dtype: Callable[[torch.device], torch.dtype | None] = lambda device: None
    """``--dtype auto``'s dtype for this row on ``device``; None: the device's own."""
    file_blocks: bool = False
    """Computes on a GGUF file's own blocks (``gguf.blocks.FileRows``): a GGUF file only."""
    plain_where_unsupported: bool = False
    """Where no format runs (and off the CPU), plain weights (``F.linear``), not a refusal."""


_NATIVE_LINEAR = ("the native linear kernels of the dtype (bfloat16 on a CPU with "
                  "AVX512-BF16, float32 on one with AVX2 and FMA; kernels auto or native)")
QUANTIZATIONS: dict[str, Quantization] = {row.name: row for row in (
    Quantization(
        "none", "weights in the dtype", (NativeFormat, OneDNNFormat), "", "",
        plain_where_unsupported=True),
    Quantization(
        "int8", "int8 weights, a scale per output row; activations in the dtype",
        (NativeInt8Format, Int8Format), "bfloat16 or float32", "none"),
    Quantization(
        "int4", "4-bit weights, a scale and minimum per 32 inputs (GGUF Q4_1's form); "
        "activations in the dtype; the output head in int8",
        (NativeInt4Format, Int4Format), "bfloat16 or float32", "int8"),
    Quantization(
        "w4a8", "int4's weights times activations quantized to int8 per 32 inputs at every "
        "call; the output head in 8 bits", (NativeVnniW4A8Format, NativeW4A8Format),
        "the native kernels of a CPU with AVX512-VNNI, or with AVX2, FMA and F16C (kernels "
        "auto or native)", "int4", auto_dtype=_float32_without_vnni),
    Quantization(
        "w8a8", "int8's weights times activations quantized to int8 per 64 (or 32) inputs "
        "at every call, the output head too", (NativeW8A8Format,),
        "the native kernels of a CPU with AVX512-VNNI (kernels auto or native)", "int8"),
    Quantization(
        "gguf", "a GGUF file's own blocks, exactly, in the native int8 and int4 kernels; "
        "the other types in the dtype", (GGUFFormat,), _NATIVE_LINEAR, "none",
        file_blocks=True),
    Quantization(
        "gguf-llama-cpp", "a GGUF file's values in float32 times activations rounded as "
        "llama.cpp's CPU backend rounds them", (LlamaCppFormat,), "float32", "none",
        auto_dtype=lambda device: torch.float32, file_blocks=True),
)}
assert tuple(QUANTIZATIONS) == QUANTIZATION_CHOICES, "one row per quantization_names choice"


def resolve_dtype(name: str, device: torch.device, quantization: str = "none") -> torch.dtype:
    """``--dtype`` ``name`` for ``quantization`` on ``device``: ``auto`` is the row's own
    dtype where it has one, else the device's (``hardware.device_dtype``)."""
    if name == "auto":
        own = QUANTIZATIONS[quantization].auto_dtype(device)
        if own is not None:
            return own
    return device_dtype(name, device)


def resolve_quantization(name: str, path: str, dtype_name: str, device: torch.device,
                         kernels: NativeKernels | None, batch_invariant: bool = False) -> str:
    """The table's row ``--quantization name`` takes for the model at ``path``: ``auto`` is
    ``gguf`` for a GGUF file storing quantized matrices where that row runs here (the CPU,
    with the native linear kernels of ``--dtype dtype_name``'s dtype: the file's own blocks,
    with no dequantized copy), and ``none`` elsewhere (a folder, a float GGUF file,
    another device, ``batch_invariant``, which takes native formats alone); any other
    name is that row."""
    if name != "auto":
        return name
    if (batch_invariant or device.type != "cpu" or os.path.isdir(path)
            or not holds_quantized_matrices(path)):
        return "none"
    dtype = resolve_dtype(dtype_name, device, "gguf")
    return "gguf" if GGUFFormat.supports(dtype, kernels) else "none"


def check_source(quantization: str, path: str, is_folder: bool) -> None:
    """Raises ``InvalidParameterError`` where the model at ``path`` (a folder, or a file)
    cannot give ``quantization`` its weights: a row of ``file_blocks`` needs a GGUF file."""
    if is_folder and QUANTIZATIONS[quantization].file_blocks:
        others = [row.name for row in QUANTIZATIONS.values() if not row.file_blocks]
        raise InvalidParameterError(
            f"--quantization {quantization} computes on a GGUF file's own blocks; {path} is "
            f"a folder: use {', '.join(others[:-1])} or {others[-1]}", "quantization")


def choose_weight_format(dtype: torch.dtype, device: torch.device, quantization: str = "none",
                         kernels: NativeKernels | None = None,
                         batch_invariant: bool = False) -> WeightFormat | None:
    """The format every projection takes after loading; None keeps plain weights.
    ``kernels``: the engine's native kernels, None where it uses PyTorch's;
    ``batch_invariant``: native formats only (see the module docstring).

    Raises ``InvalidParameterError`` for a quantization this device or dtype cannot run,
    and with ``batch_invariant`` where no native format takes the dtype.
    """
    row = QUANTIZATIONS[quantization]
    if batch_invariant:
        return _native_format(row, dtype, device, kernels)
    if device.type != "cpu":
        if row.plain_where_unsupported:
            return None
        raise InvalidParameterError(f"--quantization {quantization} runs on the CPU only",
                                    "quantization")
    dense = None if row.name == "none" else choose_weight_format(dtype, device, "none", kernels)
    for fmt in row.formats:
        if fmt.supports(dtype, kernels):
            return fmt.build(dtype, kernels, dense)
    if row.plain_where_unsupported:
        return None
    raise _refusal(row, dtype, kernels)


def _refusal(row: Quantization, dtype: torch.dtype,
             kernels: NativeKernels | None) -> InvalidParameterError:
    """Why ``row`` does not run in ``dtype`` here: the dtypes it runs in here, or what it
    needs."""
    dtypes = [str(d).removeprefix("torch.") for d in (torch.bfloat16, torch.float32)
              if any(fmt.supports(d, kernels) for fmt in row.formats)]
    if dtypes:
        return InvalidParameterError(
            f"--quantization {row.name} takes {' or '.join(dtypes)} activations here: use "
            f"--dtype {' or '.join(dtypes)}", "quantization")
    return InvalidParameterError(f"--quantization {row.name} needs {row.needs}: use "
                                 f"{row.instead}", "quantization")


def _native_format(row: Quantization, dtype: torch.dtype, device: torch.device,
                   kernels: NativeKernels | None) -> WeightFormat:
    """The first of ``row``'s native formats that keeps every row of a call alone at every
    size here (its ``row_invariant``), its output head native too (``batch_invariant``)."""
    if device.type == "cpu":
        for fmt in row.formats:
            if issubclass(fmt, KernelWeightFormat) and fmt.row_invariant(dtype, kernels):
                chosen = fmt.build(dtype, kernels, None)
                if isinstance(chosen.head, KernelWeightFormat):
                    return chosen
    raise InvalidParameterError(
        f"--batch-invariant needs the native linear kernels for {str(dtype).removeprefix('torch.')}"
        f" (quantization {row.name}): bfloat16 on a CPU with AVX512-BF16, float32 on one "
        "with AVX2 and FMA, and kernels auto or native", "batch_invariant")
