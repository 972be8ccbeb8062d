"""The GGUF tensor types tokenmill reads, and a matrix's rows as the file stores them.

``SUPPORTED_TYPES``: every type a tensor of a loadable file may have. ``FileRows`` holds
one matrix in the file's own bytes (``[rows, bytes per row]`` uint8, whole blocks per
row) in torch's row order, and decodes it:

- ``dequantize()``: float32 ``[rows, cols]`` by the gguf package's reference
  dequantization (``gguf.quants.dequantize``), bit for bit.
- ``int8_groups()``, for ``INT8_GROUP_TYPES`` only: the weight as int8 ``q`` and a float32
  scale per ``int8_group`` inputs of a row (``INT8_GROUPS``), ``w = q * scale``. Per 32:
  Q8_0 (``d q``, ``q`` int8) gives ``(q, d)``; Q5_0 (``d (q - 16)``, ``q`` in 0..31)
  ``(q - 16, d)``, the scale the block's float16 ``d`` widened. Per 16, in a super-block
  of 256 with a float16 ``d``: Q6_K (``d sc (q - 32)``, ``sc`` int8 per 16, ``q`` 6-bit)
  gives ``(q - 32, d sc)``; Q3_K (``d (sc - 32) q``, ``sc`` 6-bit per 16, ``q`` in -4..3)
  ``(q, d (sc - 32))``, the scale exact in float32 (11 by at most 7 significant bits).
  Either way ``scale`` is the float32 number the reference multiplies ``q`` by, so ``q *
  scale`` in float32 equals ``dequantize()`` bit for bit.
- ``int4_planes()``, for ``PLANE_TYPES`` only: the weight as a sum of one or two 4-bit
  planes, each ``(q, scales, mins)`` with ``q`` in 0..15 and a float32 scale and minimum
  per 32 inputs of a row, ``w = sum over planes of (q * scale + min)``. Every product
  ``q * scale`` is exact in float32. One plane, for the 4-bit types: Q4_0 (``d (q - 8)``)
  gives ``(d, -8 d)``; Q4_1 (``d q + m``) ``(d, m)``; Q4_K, a super-block of 256 with a
  float16 ``d`` and ``dmin`` and per 32 a 6-bit scale ``sc`` and minimum ``mn``
  (``d sc q - dmin mn``), ``(d sc, -(dmin mn))`` (``d sc``: 11 by 6 significant bits,
  exact). Two planes, the low nibble and the high bit, for the 5-bit types with a minimum,
  which int8 with a scale alone cannot hold: Q5_1 (``d q + m``) and Q5_K (Q4_K's form with
  5-bit ``q``). Exactness: for the 4-bit types ``q * scale + min`` in float32 equals
  ``dequantize()`` bit for bit; for Q5_1 and Q5_K the planes sum to the exact value
  ``d q + m``, which ``dequantize()`` rounds once to float32 (they differ from it by at
  most half a float32 unit in the last place).
- ``own_fields()``, for ``FIELD_TYPES`` only: the blocks' fields as the file stores them,
  each ``[rows, values per row]`` (the integer kernels over int8 activations take these):
  Q4_K (``d sc q - dmin mn``) gives ``(q, sc, mn, d, dmin)``: ``q`` uint8 in 0..15, the
  6-bit ``sc`` and ``mn`` uint8 per 32 inputs, ``d`` and ``dmin`` float16 per 256; Q6_K
  (``d sc (q - 32)``) ``(q, sc, d)``: ``q`` uint8 in 0..63, ``sc`` int8 per 16, ``d``
  float16 per 256; Q8_0 (``d q``) ``(q, d)``: ``q`` int8, ``d`` float16 per 32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

Q = GGMLQuantizationType
SUPPORTED_TYPES = (
    Q.F32, Q.F16, Q.BF16,
    Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.MXFP4,  # gpt-oss's experts: 32 4-bit floats (E2M1) and a power-of-two scale (E8M0)
)
DENSE_TYPES = (Q.F32, Q.F16, Q.BF16)  # the float types: every other one is quantized
Int8Groups = tuple[torch.Tensor, torch.Tensor]  # q, scales
Int4Plane = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, scales, mins


@dataclasses.dataclass(frozen=True)
class FileRows:
    """A matrix of ``cols`` columns in GGUF type ``qtype``: ``data [rows, bytes per row]``
    uint8, row ``r`` of the matrix in ``data[r]`` (a row is whole blocks)."""

    qtype: GGMLQuantizationType
    data: np.ndarray
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    def take(self, rows: torch.Tensor) -> FileRows:
        """The rows ``rows`` (indices), in that order."""
        return FileRows(self.qtype, self.data[rows.numpy()], self.cols)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]``, as ``gguf.quants.dequantize`` computes it."""
        bytes_per_row = self.data.shape[1]
        array = dequantize(self.data.reshape(-1, bytes_per_row), self.qtype)
        if not array.flags.writeable:  # an F32 view of the file: copy it out
            array = np.array(array)
        return torch.from_numpy(array.reshape(self.shape))

    @property
    def int8_group(self) -> int:
        """Inputs per scale of ``int8_groups()``: 32 or 16; only for ``INT8_GROUP_TYPES``."""
        return INT8_GROUPS[self.qtype]

    def int8_groups(self) -> Int8Groups:
        """The weight as ``(q [rows, cols] int8, scales [rows, cols / int8_group] float32)``,
        ``w = q * scale`` exactly (see the module's docstring); only for
        ``INT8_GROUP_TYPES``."""
        assert self.qtype in INT8_GROUP_TYPES, f"{self.qtype.name} has no int8 groups"
        q, scales = _INT8_DECODERS[self.qtype](self._blocks())
        return self._matrix(q), self._per_group(scales)

    def int4_planes(self) -> list[Int4Plane]:
        """The weight as 4-bit planes ``(q [rows, cols] uint8, scales, mins [rows, cols /
        32] float32)`` (see the module's docstring); only for ``PLANE_TYPES``."""
        assert self.qtype in PLANE_TYPES, f"{self.qtype.name} has no 4-bit planes"
        return [(self._matrix(q), self._per_group(scales), self._per_group(mins))
                for q, scales, mins in _PLANE_DECODERS[self.qtype](self._blocks())]

    def own_fields(self) -> tuple[torch.Tensor, ...]:
        """The blocks' fields, each ``[rows, values per row]`` (see the module's docstring);
        only for ``FIELD_TYPES``."""
        assert self.qtype in FIELD_TYPES, f"{self.qtype.name} has no decoded fields here"
        return tuple(torch.from_numpy(np.ascontiguousarray(field).reshape(self.shape[0], -1))
                     for field in _FIELD_DECODERS[self.qtype](self._blocks()))

    def _blocks(self) -> np.ndarray:
        """``[blocks, bytes per block]`` uint8, the blocks in row order."""
        _, type_size = GGML_QUANT_SIZES[self.qtype]
        return np.ascontiguousarray(self.data).reshape(-1, type_size)

    def _matrix(self, values: np.ndarray) -> torch.Tensor:
        """``[blocks, block size]`` values -> ``[rows, cols]``."""
        return torch.from_numpy(values.reshape(self.shape))

    def _per_group(self, values: np.ndarray) -> torch.Tensor:
        """``[blocks, groups per block]`` values -> ``[rows, groups per row]`` (a row is
        whole blocks)."""
        return torch.from_numpy(values.reshape(self.shape[0], -1))


def _half(field: np.ndarray) -> np.ndarray:
    """``[blocks, 2]`` bytes holding a float16 -> ``[blocks, 1]`` float16."""
    return np.ascontiguousarray(field).view(np.float16)


def _f16(field: np.ndarray) -> np.ndarray:
    """``[blocks, 2]`` bytes holding a float16 -> ``[blocks, 1]`` float32."""
    return _half(field).astype(np.float32)


def _fields(qs: np.ndarray, run: int, width: int) -> np.ndarray:
    """``[blocks, B]`` bytes -> ``[blocks, 8 B / width]`` values of ``width`` bits: each run
    of ``run`` bytes gives its lowest fields, then the next ones up (GGUF's order within a
    block)."""
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(1, 1, -1, 1)
    split = qs.reshape(qs.shape[0], -1, 1, run) >> shifts
    return (split & np.uint8((1 << width) - 1)).reshape(qs.shape[0], -1)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """``_fields`` of 4 bits: each run's low nibbles, then its high ones."""
    return _fields(qs, run, 4)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """``[blocks, count / 8]`` bytes -> ``[blocks, count]`` bits, least significant first."""
    return np.unpackbits(qh, axis=-1, count=count, bitorder="little")


NpGroups = tuple[np.ndarray, np.ndarray]
NpPlane = tuple[np.ndarray, np.ndarray, np.ndarray]


def _q8_0(blocks: np.ndarray) -> NpGroups:
    q, d = _q8_0_fields(blocks)
    return q, d.astype(np.float32)


def _q5_0(blocks: np.ndarray) -> NpGroups:
    q = _nibbles(blocks[:, 6:], 16) | (_bits(blocks[:, 2:6], 32) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), _f16(blocks[:, :2])


def _q6_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ql (128 bytes: q's low nibbles), qh (64: its high 2 bits), sc (16 int8), d:
    ``(q in 0..63, sc, d)``."""
    q = _nibbles(blocks[:, :128], 64) | (_fields(blocks[:, 128:192], 32, 2) << np.uint8(4))
    return q, blocks[:, 192:208].view(np.int8), _half(blocks[:, 208:210])


def _q6_k(blocks: np.ndarray) -> NpGroups:
    q, sc, d = _q6_k_fields(blocks)
    return q.astype(np.int8) - np.int8(32), d.astype(np.float32) * sc.astype(np.float32)


def _q3_k(blocks: np.ndarray) -> NpGroups:
    """hmask (32 bytes: a set bit means no -4), qs (64: q's low 2 bits), sc (12: 16 6-bit
    values, the low nibbles in 8 bytes, the high 2 bits in 4), d."""
    low = _fields(blocks[:, 32:96], 32, 2).astype(np.int8)
    minus_4 = (_fields(blocks[:, :32], 32, 1) ^ np.uint8(1)) << np.uint8(2)
    sc = _nibbles(blocks[:, 96:104], 8) | (_fields(blocks[:, 104:108], 4, 2) << np.uint8(4))
    scales = _f16(blocks[:, 108:110]) * (sc.astype(np.int8) - np.int8(32)).astype(np.float32)
    return low - minus_4.astype(np.int8), scales


def _q4_0(blocks: np.ndarray) -> list[NpPlane]:
    d = _f16(blocks[:, :2])
    return [(_nibbles(blocks[:, 2:], 16), d, d * np.float32(-8))]


def _q4_1(blocks: np.ndarray) -> list[NpPlane]:
    return [(_nibbles(blocks[:, 4:], 16), _f16(blocks[:, :2]), _f16(blocks[:, 2:4]))]


def _q4_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """d, dmin (float16), sc and mn (12 bytes: 8 6-bit values each), qs (128: q's
    nibbles): ``(q, sc, mn, d, dmin)``."""
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    return (_nibbles(blocks[:, 16:], 32), sc, mn, _half(blocks[:, :2]), _half(blocks[:, 2:4]))


def _q8_0_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return blocks[:, 2:].view(np.int8), _half(blocks[:, :2])


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's per-32 scales ``d sc`` and minimums ``-(dmin mn)``: ``[blocks,
    8]`` float32 each, exact."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q4_k(blocks: np.ndarray) -> list[NpPlane]:
    return [(_nibbles(blocks[:, 16:], 32), *_k_scales(blocks))]


def _q5_1(blocks: np.ndarray) -> list[NpPlane]:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    high = _bits(blocks[:, 4:8], 32)
    return [(_nibbles(blocks[:, 8:], 16), d, m), (high, d * np.float32(16), np.zeros_like(d))]


def _q5_k(blocks: np.ndarray) -> list[NpPlane]:
    scales, mins = _k_scales(blocks)
    # qh's bit j of byte i is input i of the j-th run of 32
    high = _bits(blocks[:, 16:48].reshape(-1, 32, 1), 8).transpose(0, 2, 1)
    return [(_nibbles(blocks[:, 48:], 32), scales, mins),
            (np.ascontiguousarray(high).reshape(-1, 256), scales * np.float32(16),
             np.zeros_like(mins))]


_INT8_DECODERS = {Q.Q8_0: _q8_0, Q.Q5_0: _q5_0, Q.Q6_K: _q6_k, Q.Q3_K: _q3_k}
_PLANE_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k, Q.Q5_1: _q5_1, Q.Q5_K: _q5_k}
INT8_GROUP_TYPES = tuple(_INT8_DECODERS)  # the types int8 with a scale per group holds exactly
INT8_GROUPS = {Q.Q8_0: 32, Q.Q5_0: 32, Q.Q6_K: 16, Q.Q3_K: 16}  # their inputs per scale
PLANE_TYPES = tuple(_PLANE_DECODERS)  # the others that 4-bit planes hold (see above)
# the 4-bit types whose scales and minimums are float16 numbers (Q4_0's -8 d, unless it
# overflows float16)
HALF_PLANE_TYPES = (Q.Q4_0, Q.Q4_1)
_FIELD_DECODERS = {Q.Q4_K: _q4_k_fields, Q.Q6_K: _q6_k_fields, Q.Q8_0: _q8_0_fields}
FIELD_TYPES = tuple(_FIELD_DECODERS)  # the types own_fields() decodes
