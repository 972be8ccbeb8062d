"""The grammar's allowed-token bitmask applied to logits: -inf at every forbidden id, in
the constrained rows only, in the logits' own dtype (no float32 copy of the batch).

A bitmask row holds bit ``t % 32`` of int32 word ``t // 32`` for token ``t``; in memory
(little-endian) that is bit ``t % 8`` of byte ``t // 8``, so ``numpy.unpackbits(...,
bitorder="little")`` lays the bits out in token order.

On the CPU the rows are written through numpy, one single-threaded pass per row over
the logits' memory (as integers of the logits' width, -inf's bit pattern where a bit is
0): a few hundred microseconds for 16 rows of a 49k vocabulary, and no parallel region
whose threads would contend with the model's on a busy machine. Elsewhere (CUDA) the
same is done with torch ops.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

_SAME_WIDTH_INT = {2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[rows[i], t]`` to -inf wherever bit t of ``bitmask[i]`` is 0."""
    vocab_size = logits.shape[1]
    assert bitmask.shape[1] * 32 >= vocab_size, "one bit per id of the vocabulary"
    width = logits.element_size()
    if (logits.device.type == "cpu" and logits.is_contiguous() and width in _SAME_WIDTH_INT
            and sys.byteorder == "little"):
        torch_int, np_int = _SAME_WIDTH_INT[width]
        neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype).view(torch_int).item()
        words = logits.view(torch_int).numpy()
        bytes_ = np.ascontiguousarray(bitmask.numpy()).view(np.uint8)
        forbidden = np.unpackbits(~bytes_, axis=1, bitorder="little")[:, :vocab_size]
        for i, row in enumerate(rows.tolist()):
            np.copyto(words[row], np_int(neg_inf), where=forbidden[i].view(bool))
        return
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    forbidden_rows = ((bitmask.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, :vocab_size] == 0
    logits[rows] = logits[rows].masked_fill_(forbidden_rows, float("-inf"))
