"""How a projection's weight is stored for the kernels that multiply by it: the weight
formats the table of quantizations (``quantizations``) chooses from.

A format's ``supports(dtype, kernels)`` says where it runs (and, for the native formats,
where they are the fastest choice); ``build`` makes it for a model; every ``Linear`` is
built with it (the output head with its ``head``) and converts its plain ``[out, in]``
weight once, after loading, into the format's packed-weight class:

- ``NativeFormat``: the native kernels' own layout (``native_weights.NativeWeight``),
  where they take the dtype: bfloat16 on a CPU with AVX512-BF16 (on an AMX CPU only where
  they multiply on its tiles: without them oneDNN's tiles multiply a prefill's rows
  faster), float32 on one with AVX2 and FMA but no AVX-512 (where oneDNN has AVX-512 its
  float32 kernels are twice the native one's peak).
- ``OneDNNFormat``: oneDNN's blocked layout (``torch_weights.OneDNNWeight``) in float32,
  bfloat16 or float16, where oneDNN can reorder the dtype (its bfloat16 reorder needs
  AVX512-BW/VL/DQ or AVX-NE-CONVERT, so an AVX2-only host keeps bfloat16 weights plain).
- ``Int8Format`` / ``NativeInt8Format``: int8 weights with one scale per output row,
  widened inside the kernel; activations stay in floating point. The native kernel where
  ``NativeFormat`` would take the dtype, else PyTorch's.
- ``Int4Format`` / ``NativeInt4Format``: likewise, 4-bit weights with a scale and a
  minimum per 32 inputs of a row (GGUF Q4_1's form: from a Q4_1 file's weights it
  recovers the file's own 4-bit values). The output head keeps 8 bits.
- ``NativeVnniW4A8Format`` / ``NativeW4A8Format``: int4's weights (float16 scales and
  minimums) times activations quantized to int8 at every call per group of 32 inputs,
  multiplied as integers: bfloat16 or float32 activations on a CPU with AVX512-VNNI
  (``NativeVnniW4A8Weight``), float32 elsewhere on a CPU with AVX2, FMA and F16C
  (``NativeW4A8Weight``). No PyTorch form. The output head keeps 8-bit weights: w8a8's on
  VNNI, else int8 with float32 activations.
- ``NativeW8A8Format``: int8's weights times activations quantized to int8 per block of
  64 inputs (32 where 64 do not divide a row) at every call, multiplied as integers
  (AVX512-VNNI), the output head too. No PyTorch form.
- ``GGUFFormat``: a GGUF file's own values (``docs/gguf.md``). On a CPU with AVX512-VNNI
  (bfloat16 or float32 activations) rows of Q4_K, Q6_K and Q8_0 compute on their own
  blocks times activations quantized to int8 at every call, multiplied as integers, as
  llama.cpp does (``NativeVnniQ4KWeight``, ``NativeVnniQ6KWeight``,
  ``NativeVnniQ8_0Weight``), and rows of Q4_0 and Q4_1 on w4a8's (their float16 scales
  and minimums); the weights exactly, the activations rounded per block of 32 inputs (Q6_K:
  16). Elsewhere, and for the other types there: rows of Q8_0 and Q5_0, Q6_K and Q3_K
  (``gguf.blocks.INT8_GROUP_TYPES``) compute as int8 with a scale per 32 or per 16 inputs
  in the native int8 kernel, rows of a type that 4-bit planes hold
  (``gguf.blocks.PLANE_TYPES``: Q4_0, Q4_1, Q4_K in one, Q5_1, Q5_K in two) on them in the
  native int4 kernel, both exactly with the activations as they are; the rows of other
  types (Q2_K, the float types) in the format ``none`` gives them (their values in the
  dtype: exact in float32).
- ``LlamaCppFormat``: a GGUF file's values in float32 times activations rounded before
  each product as llama.cpp's CPU backend rounds them for the weight's type
  (``gguf.llama_cpp_rounding``): llama.cpp's products on the file, for comparing with it;
  the weights in the format ``none`` gives float32.
"""

from __future__ import annotations

import functools
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from tokenmill.kernels import NativeKernels
from tokenmill.models.gguf.blocks import (
    FIELD_TYPES,
    HALF_PLANE_TYPES,
    INT8_GROUP_TYPES,
    PLANE_TYPES,
    FileRows,
)
from tokenmill.models.gguf.llama_cpp_rounding import (
    VEC_DOT_TYPES,
    Q8_1ActivationsWeight,
    RoundedActivationsWeight,
    rounded_weight,
)
from tokenmill.models.weights.native_weights import (
    NativeInt4PlanesWeight,
    NativeInt4Weight,
    NativeInt8GroupWeight,
    NativeInt8Weight,
    NativeVnniQ4KWeight,
    NativeVnniQ6KWeight,
    NativeVnniQ8_0Weight,
    NativeVnniW4A8Weight,
    NativeW4A8Weight,
    NativeW8A8Weight,
    NativeWeight,
    interleave_gate_up,
)
from tokenmill.models.weights.torch_weights import (
    Int4Weight,
    Int8Weight,
    OneDNNWeight,
    onednn_supports,
)


class StackedRowsWeight:
    """A weight packed in parts, each a run of its output rows (in order): the outputs of
    the parts side by side. ``add`` rounds the product, then the sum."""

    def __init__(self, parts: list[PackedWeight]) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self(x).add_(residual)


PackedWeight = (OneDNNWeight | NativeWeight | Int8Weight | NativeInt8Weight
                | NativeInt8GroupWeight | Int4Weight | NativeInt4Weight | NativeInt4PlanesWeight
                | NativeW4A8Weight | NativeVnniW4A8Weight | NativeVnniQ4KWeight
                | NativeVnniQ6KWeight | NativeVnniQ8_0Weight | StackedRowsWeight
                | RoundedActivationsWeight | Q8_1ActivationsWeight)
QUANTIZED_DTYPES = (torch.bfloat16, torch.float32)  # what int8 and int4 compute in
# packs a run of a weight's rows (and their bias) from the file's rows they were read from
RowsPacker = Callable[[torch.Tensor, torch.Tensor | None, list[FileRows]], PackedWeight]


class WeightFormat(ABC):
    """One way of storing every projection. Invariant: ``choose_weight_format`` returns a
    format only where its ``supports`` holds for the model's dtype and kernels. ``pack``
    builds the format's ``packed`` class from a weight and its bias."""

    packed: type
    reads_file_rows = False
    """Whether ``pack_rows`` takes a weight's values from the file's rows alone: its
    ``weight`` then gives the shape and dtype only, and the loader leaves it unwritten (no
    dequantized copy of the file in memory)."""

    @staticmethod
    @abstractmethod
    def supports(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        """Whether this CPU runs the format with ``dtype`` activations (and, for a native
        format, it is the fastest there); ``kernels``: the engine's native kernels, None
        where it uses PyTorch's."""

    @classmethod
    def build(cls, dtype: torch.dtype, kernels: NativeKernels | None,
              dense: WeightFormat | None) -> WeightFormat:
        """The format for a model of ``dtype`` activations computing with ``kernels``;
        ``dense``: the format ``none`` gives that model, for a format that keeps some
        weights as they are."""
        return cls()

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedWeight:
        """``weight [out, in]`` and ``bias`` converted into this format."""
        return self.packed(weight, bias)

    def pack_rows(self, weight: torch.Tensor, bias: torch.Tensor | None,
                  rows: list[FileRows]) -> PackedWeight:
        """``pack``, given also the GGUF rows ``weight`` was read from (``rows``, stacked
        in order, make up all of it); a format that computes on a file's own blocks
        overrides it."""
        return self.pack(weight, bias)

    @property
    def head(self) -> WeightFormat:
        """The output head's format: this one, but for 4-bit formats, whose head keeps 8
        bits (a GGUF file stores it in 8 bits; 4 bits there cost accuracy)."""
        return self

    def gates_silu(self, dtype: torch.dtype) -> bool:
        """Whether this format's kernel applies a SiLU gate in its epilogue for ``dtype``
        activations (``pack_silu_gated``)."""
        return False

    def pack_silu_gated(self, weight: torch.Tensor) -> PackedWeight | None:
        """A gated MLP's gate/up weight ``[2I, in]`` (gate rows, then up rows; no bias)
        packed so that one kernel call gives ``silu(x @ gate.T) * (x @ up.T)`` ``[M, I]``:
        the gate applied to the float32 sums, one rounding, no ``[M, 2I]`` product in
        memory. None where the format's kernel does not gate (``gates_silu``) or ``I`` is
        not a multiple of 16: the caller then projects and gates apart."""
        if not self.gates_silu(weight.dtype) or weight.shape[0] % 32:
            return None
        packed = self.pack(interleave_gate_up(weight), None)
        packed.linear = functools.partial(packed.linear, gated=True)
        return packed


class KernelWeightFormat(WeightFormat):
    """A format of the engine's native kernels, whose packed weights take them first."""

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    @classmethod
    def build(cls, dtype: torch.dtype, kernels: NativeKernels | None,
              dense: WeightFormat | None) -> WeightFormat:
        return cls(kernels)

    @classmethod
    def row_invariant(cls, dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        """Whether the format's kernel runs here for ``dtype``, fastest or not (for
        ``batch_invariant``, which takes the native formats alone)."""
        return cls.supports(dtype, kernels)

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedWeight:
        return self.packed(self.kernels, weight, bias)


def native_linear(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
    """Whether the native linear kernels (float, int8, int4 weights) for ``dtype``
    activations are in this build (``KernelCapabilities.linear``)."""
    return kernels is not None and kernels.capabilities.linear(dtype)


def native_linear_fastest(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
    """``native_linear``, but float32 where the CPU has AVX-512: oneDNN's float32 kernels
    are twice the native one's peak there, so PyTorch's formats take float32."""
    return native_linear(dtype, kernels) and not (dtype == torch.float32
                                                  and kernels.capabilities.avx512)


class OneDNNFormat(WeightFormat):
    packed = OneDNNWeight

    @staticmethod
    def supports(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        return onednn_supports(dtype)


class NativeLinearFormat(KernelWeightFormat):
    """A format of the native linear kernels of the dtype (float, int8 or int4 weights):
    chosen where they are the fastest, and row-invariant wherever they are built."""

    @staticmethod
    def supports(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        return native_linear_fastest(dtype, kernels)

    @classmethod
    def row_invariant(cls, dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        return native_linear(dtype, kernels)


class NativeFormat(NativeLinearFormat):
    packed = NativeWeight

    @staticmethod
    def supports(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        return (native_linear_fastest(dtype, kernels)
                and not (dtype == torch.bfloat16 and kernels.capabilities.amx
                         and not kernels.capabilities.linear_tiles))

    def gates_silu(self, dtype: torch.dtype) -> bool:
        """bfloat16 (``bf16_linear``) without AMX: a gated call multiplies without tiles,
        and the tiles multiply a prefill's gate/up rows faster than the gate saves."""
        return dtype == torch.bfloat16 and not self.kernels.capabilities.amx


class Int8Format(WeightFormat):
    packed = Int8Weight

    @staticmethod
    def supports(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        return dtype in QUANTIZED_DTYPES


class NativeInt8Format(NativeLinearFormat):
    packed = NativeInt8Weight


class Int4Format(WeightFormat):
    packed = Int4Weight

    @staticmethod
    def supports(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        return dtype in QUANTIZED_DTYPES

    @property
    def head(self) -> WeightFormat:
        return Int8Format()


class NativeInt4Format(NativeLinearFormat):
    packed = NativeInt4Weight

    @property
    def head(self) -> WeightFormat:
        return NativeInt8Format(self.kernels)


class NativeW4A8Format(KernelWeightFormat):
    packed = NativeW4A8Weight

    @staticmethod
    def supports(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        return (dtype == torch.float32 and kernels is not None
                and kernels.capabilities.w4a8_linear)

    @property
    def head(self) -> WeightFormat:
        """int8 with float32 activations: native where the CPU has that kernel."""
        if NativeInt8Format.supports(torch.float32, self.kernels):
            return NativeInt8Format(self.kernels)
        return Int8Format()


class NativeW8A8Format(KernelWeightFormat):
    packed = NativeW8A8Weight

    def __init__(self, kernels: NativeKernels, dtype: torch.dtype) -> None:
        super().__init__(kernels)
        self.dtype = dtype  # the activations'

    @classmethod
    def build(cls, dtype: torch.dtype, kernels: NativeKernels | None,
              dense: WeightFormat | None) -> WeightFormat:
        return cls(kernels, dtype)

    @staticmethod
    def supports(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        return (dtype in (torch.bfloat16, torch.float32) and kernels is not None
                and kernels.capabilities.vnni_linear)

    def gates_silu(self, dtype: torch.dtype) -> bool:
        return True

    @property
    def head(self) -> WeightFormat:
        """w8a8 too: on the embedded model it costs no more than an int8 head with the
        dtype's activations (perplexity +0.04% against +0.01%, mean KL from float32 0.0138
        against 0.0131 nats) and is 1.9x as fast at 64 rows."""
        return self


class NativeVnniW4A8Format(NativeW8A8Format):
    """The output head in w8a8 (a 4-bit head costs several percent of perplexity)."""

    packed = NativeVnniW4A8Weight

    @property
    def head(self) -> WeightFormat:
        return NativeW8A8Format(self.kernels, self.dtype)


class GGUFFormat(WeightFormat):
    """A GGUF file's own values, unchanged, each run of rows of one route (``_route``) packed
    on its own. With ``integer`` (the VNNI kernels run the dtype: ``NativeW8A8Format.
    supports``) rows of ``FIELD_TYPES`` (Q4_K, Q6_K, Q8_0) on their own blocks' fields
    (``NativeVnniQ4KWeight``, ``NativeVnniQ6KWeight``, ``NativeVnniQ8_0Weight``, one weight
    a type) and rows of ``HALF_PLANE_TYPES`` (Q4_0, Q4_1) on ``NativeVnniW4A8Weight`` with
    their float16 scales and minimums, activations quantized to int8 at every call. The
    other rows, and all of them without ``integer``: rows of ``INT8_GROUP_TYPES`` on the
    native int8 kernel with a scale per ``FileRows.int8_group`` (32 or 16) inputs
    (``NativeInt8GroupWeight``); rows of ``PLANE_TYPES`` on the native int4 kernel as their
    4-bit planes (one plane: ``NativeInt4Weight``; two: ``NativeInt4PlanesWeight``, rows of
    one plane given a zero second one); the others, and any weight ``pack``ed without the
    file's rows, in ``dense``, the format ``none`` takes (never None where this format is
    supported: the native linear kernels take the dtype there, so the native dense format
    or oneDNN does). Every route computes on the file's weights exactly. A fused projection
    whose shards take different routes, int8 groups of different sizes or different
    ``FIELD_TYPES``, is split where that changes (``StackedRowsWeight``). The packers read
    the values from the rows alone (``weight`` gives the shape and the dtype)."""

    reads_file_rows = True

    def __init__(self, kernels: NativeKernels, dense: WeightFormat, integer: bool) -> None:
        self.kernels = kernels
        self.dense = dense
        self.integer = integer

    @staticmethod
    def supports(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        return native_linear(dtype, kernels)

    @classmethod
    def build(cls, dtype: torch.dtype, kernels: NativeKernels | None,
              dense: WeightFormat | None) -> WeightFormat:
        assert dense is not None, "the native linear kernels take the dtype (supports)"
        return cls(kernels, dense, NativeW8A8Format.supports(dtype, kernels))

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedWeight:
        return self.dense.pack(weight, bias)

    def pack_rows(self, weight: torch.Tensor, bias: torch.Tensor | None,
                  rows: list[FileRows]) -> PackedWeight:
        return _pack_in_runs(weight, bias, rows, self._route,
                             lambda route, part, part_bias, run: route[0](part, part_bias, run))

    def _route(self, rows: FileRows) -> tuple[RowsPacker, object]:
        """The route of ``rows``: the method that packs a run of rows like them, and what
        else must be equal for rows to share a weight (int8 groups: their inputs per scale;
        own fields: the type), else None. Rows of equal routes pack together."""
        if self.integer and rows.qtype in FIELD_TYPES:
            return self._pack_own_fields, rows.qtype
        if self.integer and rows.qtype in HALF_PLANE_TYPES:
            return self._pack_half_planes, None
        if rows.qtype in INT8_GROUP_TYPES:
            return self._pack_int8_groups, rows.int8_group
        if rows.qtype in PLANE_TYPES:
            return self._pack_planes, None
        return self._pack_dense, None

    def _pack_int8_groups(self, weight: torch.Tensor, bias: torch.Tensor | None,
                          rows: list[FileRows]) -> PackedWeight:
        q, scales = (torch.cat(parts)
                     for parts in zip(*(r.int8_groups() for r in rows), strict=True))
        return NativeInt8GroupWeight(self.kernels, weight, bias, (q, scales))

    def _pack_own_fields(self, weight: torch.Tensor, bias: torch.Tensor | None,
                         rows: list[FileRows]) -> PackedWeight:
        fields = tuple(torch.cat(parts)
                       for parts in zip(*(r.own_fields() for r in rows), strict=True))
        return _FIELD_WEIGHTS[rows[0].qtype](self.kernels, weight, bias, fields)

    def _pack_half_planes(self, weight: torch.Tensor, bias: torch.Tensor | None,
                          rows: list[FileRows]) -> PackedWeight:
        """On w4a8's kernel where float16 holds the scales and minimums (Q4_0's -8 d may
        overflow it: then on the int4 kernel's float32)."""
        q, scales, mins = (torch.cat(parts) for parts in zip(
            *(r.int4_planes()[0] for r in rows), strict=True))
        halves = scales.half(), mins.half()
        if not all(torch.equal(h.float(), f) for h, f in zip(halves, (scales, mins),
                                                            strict=True)):
            return self._pack_planes(weight, bias, rows)
        return NativeVnniW4A8Weight(self.kernels, weight, bias, (q, *halves))

    def _pack_planes(self, weight: torch.Tensor, bias: torch.Tensor | None,
                     rows: list[FileRows]) -> PackedWeight:
        shards = [r.int4_planes() for r in rows]
        count = max(len(planes) for planes in shards)
        for planes in shards:
            q, scales, _ = planes[0]
            while len(planes) < count:  # a plane of zeros: q, scale and minimum 0
                planes.append((torch.zeros_like(q), torch.zeros_like(scales),
                               torch.zeros_like(scales)))
        planes = [tuple(torch.cat(parts) for parts in zip(*shard_planes, strict=True))
                  for shard_planes in zip(*shards, strict=True)]
        if count == 1:
            return NativeInt4Weight(self.kernels, weight, bias, planes[0])
        return NativeInt4PlanesWeight(self.kernels, weight, bias, planes)

    def _pack_dense(self, weight: torch.Tensor, bias: torch.Tensor | None,
                    rows: list[FileRows]) -> PackedWeight:
        return self.pack(file_values(rows, weight.dtype), bias)


# the weight class of each of FIELD_TYPES
_FIELD_WEIGHTS = {GGMLQuantizationType.Q4_K: NativeVnniQ4KWeight,
                  GGMLQuantizationType.Q6_K: NativeVnniQ6KWeight,
                  GGMLQuantizationType.Q8_0: NativeVnniQ8_0Weight}


class LlamaCppFormat(WeightFormat):
    """A GGUF file's values in ``dense`` (the format ``none`` gives float32), each run of
    rows of one ``llama_cpp_rounding.VEC_DOT_TYPES`` packed on its own behind the rounding
    of the activations llama.cpp applies for them; split where that type changes
    (``StackedRowsWeight``). A weight ``pack``ed without the file's rows keeps its input."""

    reads_file_rows = True

    def __init__(self, dense: WeightFormat) -> None:
        self.dense = dense

    @staticmethod
    def supports(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
        """float32, where ``none`` packs it (natively or by oneDNN)."""
        return dtype == torch.float32 and (NativeFormat.supports(dtype, kernels)
                                           or OneDNNFormat.supports(dtype, kernels))

    @classmethod
    def build(cls, dtype: torch.dtype, kernels: NativeKernels | None,
              dense: WeightFormat | None) -> WeightFormat:
        assert dense is not None, "none packs float32 here (supports)"
        return cls(dense)

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedWeight:
        return self.dense.pack(weight, bias)

    def pack_rows(self, weight: torch.Tensor, bias: torch.Tensor | None,
                  rows: list[FileRows]) -> PackedWeight:
        return _pack_in_runs(weight, bias, rows, lambda r: VEC_DOT_TYPES[r.qtype],
                             lambda _, part, part_bias, run: rounded_weight(
                                 self.dense.pack(file_values(run, part.dtype), part_bias),
                                 run))


def file_values(rows: list[FileRows], dtype: torch.dtype) -> torch.Tensor:
    """The weight ``rows`` (stacked in order) hold, in ``dtype``: each row's values as
    ``FileRows.dequantize`` gives them, then rounded once."""
    return torch.cat([r.dequantize() for r in rows]).to(dtype)


def _pack_in_runs(weight: torch.Tensor, bias: torch.Tensor | None, rows: list[FileRows],
                  key: Callable[[FileRows], object],
                  pack_run: Callable[..., PackedWeight]) -> PackedWeight:
    """``weight`` (and ``bias``), read from ``rows`` stacked in order, packed per run of
    rows of one ``key``: ``pack_run(key, weight rows, their bias, run)``; the parts side by
    side (``StackedRowsWeight``) where there are several."""
    parts, first = [], 0
    for run_key, run in itertools.groupby(rows, key=key):
        run = list(run)
        last = first + sum(r.shape[0] for r in run)
        part_bias = None if bias is None else bias[first:last]
        parts.append(pack_run(run_key, weight[first:last], part_bias, run))
        first = last
    return parts[0] if len(parts) == 1 else StackedRowsWeight(parts)

