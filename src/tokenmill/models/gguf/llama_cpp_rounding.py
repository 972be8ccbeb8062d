"""Activations rounded as llama.cpp's CPU backend rounds them before it multiplies them by a
GGUF weight (``--quantization gguf-llama-cpp``): llama.cpp's products, to compare with it.

llama.cpp multiplies a weight of type T by activations converted to T's "vec dot type",
one row of activations at a time, in blocks along the inputs:

- ``Q8_0``, for Q4_0, Q5_0 and Q8_0 weights (and ``Q8_1``, for Q4_1 and Q5_1, whose
  ``q`` and ``d`` are the same): per block of 32, ``d = max|x| / 127`` stored as float16,
  ``q = round(x * (127 / max|x|))``, ties to even;
- ``Q8_K``, for the K-quants (Q2_K to Q6_K): per block of 256, ``m`` the value of largest
  magnitude (the first such), ``iscale = -127 / m``, ``q = min(round(iscale * x), 127)``,
  ties to even, ``d = 1 / iscale`` in float32;
- float16 for F16 weights, bfloat16 for BF16, none for F32.

The weight's values are the file's, exactly (dequantized to float32), and each product
takes ``d * q`` for an activation: llama.cpp's integer sums times its scales, but for the
order of float32 additions. Q4_1 and Q5_1 weights (``d q + m``) multiply their minimums
by ``Q8_1``'s float16 ``s = d * sum q`` per block, not by the sum of the rounded values:
``Q8_1ActivationsWeight`` adds the difference. Everything else (norms, rotary, attention,
sampling) is as in float32; llama.cpp keeps its KV cache in float16 by default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from tokenmill.models.gguf.blocks import FileRows

Q = GGMLQuantizationType
Rounding = Callable[[torch.Tensor], torch.Tensor]


def _q8_0_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, last dimension a multiple of 32) in blocks of 32: their integers
    ``q`` ``[..., blocks, 32]`` and scales ``d`` ``[..., blocks, 1]`` (float32, before the
    float16 rounding that llama.cpp stores), as its x86 conversion computes them."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(blocks * inverse), amax / 127


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, last dimension a multiple of 32) as ``Q8_0`` blocks hold it."""
    q, scale = _q8_0_blocks(x)
    return (q * scale.to(torch.float16).float()).reshape(x.shape)


def round_q8_k(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, last dimension a multiple of 256) as ``Q8_K`` blocks hold it."""
    blocks = x.reshape(*x.shape[:-1], -1, 256)
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    nonzero = extreme != 0
    iscale = torch.where(nonzero, -127 / extreme, torch.zeros_like(extreme))
    scale = torch.where(nonzero, 1 / iscale, torch.zeros_like(extreme))
    return (torch.round(blocks * iscale).clamp(max=127) * scale).reshape(x.shape)


def round_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as ``Q8_1`` blocks hold it (``round_q8_0``'s values), and per block how far
    their float16 ``s = d * sum q`` (``d`` before its rounding to float16) lies from the
    sum of the rounded values: ``[..., blocks]``."""
    q, scale = _q8_0_blocks(x)
    scale16 = scale.to(torch.float16).float()
    sum_q = q.sum(dim=-1, keepdim=True)  # exact: at most 32 * 127
    stored_sum = (scale * sum_q).to(torch.float16).float()
    return (q * scale16).reshape(x.shape), (stored_sum - scale16 * sum_q).squeeze(-1)


def _through(dtype: torch.dtype) -> Rounding:
    return lambda x: x.to(dtype).float()


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


# the type llama.cpp converts activations to for a product with a weight of each type
VEC_DOT_TYPES = {
    Q.F32: Q.F32, Q.F16: Q.F16, Q.BF16: Q.BF16,
    **dict.fromkeys((Q.Q4_0, Q.Q5_0, Q.Q8_0), Q.Q8_0), **dict.fromkeys((Q.Q4_1, Q.Q5_1), Q.Q8_1),
    **dict.fromkeys((Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K), Q.Q8_K),
}
# the activations' values in each of those types (Q8_1's are Q8_0's)
ROUNDINGS: dict[GGMLQuantizationType, Rounding] = {
    Q.F32: _unchanged, Q.F16: _through(torch.float16), Q.BF16: _through(torch.bfloat16),
    Q.Q8_0: round_q8_0, Q.Q8_1: round_q8_0, Q.Q8_K: round_q8_k,
}


class RoundedActivationsWeight:
    """A packed weight whose input is rounded by ``rounding`` first."""

    def __init__(self, inner, rounding: Rounding) -> None:
        self.inner = inner
        self.rounding = rounding

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.rounding(x))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.inner.add(self.rounding(x), residual)


class Q8_1ActivationsWeight:
    """A packed weight of Q4_1 or Q5_1 rows (``d q + m`` per block of 32) whose input is
    rounded to ``Q8_1`` blocks first: llama.cpp multiplies the minimums by each block's
    float16 ``s`` rather than by the sum of its rounded values, so the product gains
    ``(s - sum) @ mins.T``. ``mins``: ``[out, in / 32]`` float32."""

    def __init__(self, inner, mins: torch.Tensor) -> None:
        self.inner = inner
        self.mins = mins

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rounded, sum_error = round_q8_1(x)
        return self.inner(rounded).add_(sum_error @ self.mins.T)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        rounded, sum_error = round_q8_1(x)
        return self.inner.add(rounded, residual).add_(sum_error @ self.mins.T)


def rounded_weight(inner, run: list[FileRows]):
    """``inner`` (the packed rows of ``run``, one vec dot type) behind the rounding of its
    input that llama.cpp applies for them."""
    vec_dot_type = VEC_DOT_TYPES[run[0].qtype]
    if vec_dot_type == Q.Q8_1:
        return Q8_1ActivationsWeight(inner, torch.cat(
            [sum(mins for _, _, mins in rows.int4_planes()) for rows in run]))
    return RoundedActivationsWeight(inner, ROUNDINGS[vec_dot_type])
