"""The GGUF tensor types tokenmill reads, and a matrix's rows as the file stores them.

``SUPPORTED_TYPES``: every type a tensor of a loadable file may have. ``FileRows`` holds
one matrix in the file's own bytes (``[rows, bytes per row]`` uint8, whole blocks per
row) in torch's row order, and decodes it:

- ``dequantize()``: float32 ``[rows, cols]`` by the gguf package's reference
  dequantization (``gguf.quants.dequantize``), bit for bit.
- ``int4_groups()``, for ``INT4_TYPES`` only: ``(q, scales, mins)`` with 4-bit ``q`` and a
  float32 scale and minimum per 32 inputs of a row, such that ``q * scale + min`` in
  float32 (the product exact, one rounding) equals ``dequantize()`` bit for bit. Q4_0
  (``d (q - 8)``) gives ``(d, -8 d)``; Q4_1 (``d q + m``) ``(d, m)``; Q4_K, a super-block
  of 256 with a float16 ``d`` and ``dmin`` and per 32 a 6-bit scale ``sc`` and minimum
  ``mn`` (``d sc q - dmin mn``), gives ``(d sc, -(dmin mn))``: ``d sc`` is exact in
  float32 (11 by 6 significant bits), as ``q`` times it is (4 more).
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
)
INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)  # q * scale + min per 32 inputs, q in 0..15
INT4_GROUP = 32


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

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [rows, cols] uint8, scales, mins [rows, cols / 32] float32)``, exact (see
        the module's docstring); only for ``INT4_TYPES``."""
        assert self.qtype in INT4_TYPES, f"{self.qtype.name} has no 4-bit groups"
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        blocks = np.ascontiguousarray(self.data).reshape(-1, type_size)
        q, scales, mins = _INT4_DECODERS[self.qtype](blocks)
        rows, cols = self.shape
        return (torch.from_numpy(q.reshape(rows, cols)),
                torch.from_numpy(scales.reshape(rows, cols // INT4_GROUP)),
                torch.from_numpy(mins.reshape(rows, cols // INT4_GROUP)))


def _f16(field: np.ndarray) -> np.ndarray:
    """``[blocks, 2]`` bytes holding a float16 -> ``[blocks, 1]`` float32."""
    return np.ascontiguousarray(field).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """``[blocks, B]`` bytes -> ``[blocks, 2 B]`` 4-bit values: each run of ``run`` bytes
    gives its low nibbles, then its high ones (GGUF's order within a block)."""
    split = qs.reshape(qs.shape[0], -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (split & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 2:], 16), d, d * np.float32(-8)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(blocks[:, 4:], 16), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    return (_nibbles(blocks[:, 16:], 32), d * sc.astype(np.float32),
            -(dmin * mn.astype(np.float32)))


_INT4_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k}
