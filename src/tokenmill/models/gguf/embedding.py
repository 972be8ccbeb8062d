"""A token embedding looked up in a GGUF file's own blocks.

``FileRowsEmbedding`` keeps the embedding matrix as the file stores it (``FileRows``: a
``Q6_K`` embedding of a 1B model's 49k-token vocabulary is 83 MB, where bfloat16 values
take 201 MB) and dequantizes only the rows a forward pass looks up. Invariant: a row it
returns equals the row ``FileRows.dequantize()`` gives, rounded once to the model's dtype:
what a dense ``nn.Embedding`` loaded from the same file holds.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.models.gguf.blocks import FileRows


class FileRowsEmbedding(nn.Module):
    """``input_ids [T] -> [T, hidden]`` in ``dtype``, from the file's rows ``rows``, copied
    out of the file's mapping (so that the mapping, and every page of the file read while
    loading, is released with the loader)."""

    def __init__(self, rows: FileRows, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.rows = FileRows(rows.qtype, np.array(rows.data), rows.cols)
        self.dtype = dtype
        self.device = device

    @property
    def shape(self) -> tuple[int, int]:
        """``[vocabulary, hidden]``, as the dense embedding's weight."""
        return self.rows.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).cpu()
        unique, inverse = torch.unique(ids, return_inverse=True)
        values = self.rows.take(unique).dequantize().to(self.dtype)
        return values[inverse].reshape(*input_ids.shape, -1).to(self.device)
