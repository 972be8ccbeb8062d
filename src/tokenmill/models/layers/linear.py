"""Projections: ``Linear`` (``x @ weight.T + bias``, in the weight format it is built
with after loading) and ``GatedLinear`` (a gated MLP's gate/up projection, gating too).

Parameters are created uninitialised (``torch.empty``): every one of them is overwritten by
the loader, and skipping random initialisation keeps loading a large model fast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.gguf.blocks import FileRows
from tokenmill.models.weights.formats import PackedWeight, WeightFormat


class Linear(nn.Module):
    """``y = x @ weight.T + bias``; after loading, in the weight format it is built with.

    ``pack()`` converts the loaded weight once into ``weight_format`` (a kernel's own
    layout, or int8/int4 with scales), whose kernels compute the same product faster; with
    no format (None) the module keeps the plain weight and ``F.linear``. Rows loaded from
    a GGUF file's own blocks (``keep_file_rows``) go to the format too, when they make up
    the whole weight. Invariant: after ``pack`` with a format the plain weight is released
    (an empty tensor): the module computes, it no longer loads weights.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )
        self.weight_format = weight_format
        self.packed: PackedWeight | None = None
        self.file_rows: dict[int, FileRows] = {}  # first row -> the file's rows from there

    def keep_file_rows(self, first_row: int, rows: FileRows) -> None:
        """Record that weight rows ``first_row ..`` were read from ``rows`` (for ``pack``)."""
        self.file_rows[first_row] = rows

    def has_all_file_rows(self) -> bool:
        """Whether the rows kept (``keep_file_rows``) make up the whole weight."""
        return sum(r.shape[0] for r in self.file_rows.values()) == self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` (one kernel where the format fuses the add)."""
        if self.packed is not None:
            return self.packed.add(x, residual)
        return residual + F.linear(x, self.weight, self.bias)

    def pack(self) -> None:
        """Convert the loaded weight into ``weight_format``, once, after loading (a second
        call does nothing)."""
        if self.weight_format is None or self.packed is not None:
            return
        bias = None if self.bias is None else self.bias.data
        if self.has_all_file_rows():
            rows = [self.file_rows[first] for first in sorted(self.file_rows)]
            self.packed = self.weight_format.pack_rows(self.weight.data, bias, rows)
        else:
            self.packed = self.weight_format.pack(self.weight.data, bias)
        self.file_rows = {}
        self.weight.data = self.weight.data.new_empty(0)


class GatedLinear(Linear):
    """``act(x @ gate.T) * (x @ up.T)`` ``[M, I]`` of a gate/up weight ``[2I, in]`` (gate
    rows, then up rows, no bias), loaded as a ``Linear``: after ``pack``, one kernel call
    where the format gates SiLU in its epilogue (``WeightFormat.pack_silu_gated``), else
    the projection and then ``act_and_mul`` (``[gate | up] -> [I]``)."""

    def __init__(self, in_features: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device, weight_format: WeightFormat | None,
                 act_and_mul: Callable[[torch.Tensor], torch.Tensor], silu: bool):
        super().__init__(in_features, 2 * intermediate_size, False, dtype, device,
                         weight_format)
        self.act_and_mul = act_and_mul
        self._silu = silu
        self.fused = False  # after pack: whether one kernel call gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.packed(x)
        return self.act_and_mul(super().forward(x))

    def pack(self) -> None:
        if self.packed is not None:
            return
        # gated from the plain weight alone: one packed from a file's rows was not written
        gated = (self.weight_format.pack_silu_gated(self.weight.data)
                 if self._silu and self.weight_format is not None and not self.file_rows
                 else None)
        if gated is None:
            super().pack()
            return
        self.packed, self.fused, self.file_rows = gated, True, {}
        self.weight.data = self.weight.data.new_empty(0)
