"""The 8-bit KV cache (``--kv-cache-dtype int8``): its rows, and their conversion in PyTorch.

Each (token, KV head) row of keys or values is stored as ``head_dim`` int8 values and
then its float32 scale, in the row's last 4 bytes (``head_dim + 4`` bytes in all)::

    | round(x_0 * r) ... round(x_{D-1} * r) | s (float32) |

with ``r = 127 / max |x|`` and the scale ``s = max |x| * (1 / 127)``, so one layer's
cache is an int8 tensor ``[2, num_blocks, block_size, kv_heads, D + 4]``, laid out as a
model-dtype cache is, only its rows wider. Values round to the nearest integer, ties to
even; a row of zeros has scale 0. The native kernels write (``rotary_store_kv``) and read
(the decode attention) these rows in place; with AVX512-VNNI the decode attention rounds
each query head to such a row as well and scores the keys as integers
(``KernelCapabilities.int8_kv_integer_scores``). The native prefill attention reads a
dequantized copy of its sequences' blocks (``dequantize_kv_blocks``), and the PyTorch
paths use ``quantize_rows`` and ``dequantize_rows``, which give the native ops' very
bytes and values.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # the float32 scale after a row's values


def row_width(head_dim: int, int8: bool) -> int:
    """A cache row's last dimension: ``head_dim``, or ``head_dim + 4`` bytes if 8-bit."""
    return head_dim + SCALE_BYTES if int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` (any float dtype) as 8-bit cache rows ``[..., D + 4]`` int8."""
    values = x.float()
    peak = values.abs().amax(dim=-1, keepdim=True)
    # 127 / peak divided as tensors (a scalar's division is a product); the scale a
    # product, as the native store (compiled with reciprocal math) computes it
    steps = torch.full_like(peak, 127.0)
    inv = torch.where(peak > 0, steps / peak, torch.zeros_like(peak))
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.int8,
                       device=x.device)
    rows[..., : x.shape[-1]] = torch.round(values * inv).to(torch.int8)
    rows[..., x.shape[-1]:] = (peak * (1.0 / 127.0)).view(torch.int8)
    return rows


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """8-bit cache rows ``[..., D + 4]`` as ``[..., D]`` values in ``dtype`` (each value
    times its row's scale, in float32, then rounded to ``dtype``)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scales = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scales).to(dtype)
