"""Rotary position embedding: the inverse frequencies (with Hugging Face's scalings), the
cos/sin table of every position, and the rotation of q and k heads."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The ``head_dim / 2`` inverse frequencies, float32, with the configured scaling applied.

    The unscaled formula and the llama3 smoothing are written exactly as Hugging Face's, so
    both produce bit-identical angles.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        assert factors.shape == inv_freq.shape, "one rope factor per frequency"
        return inv_freq / factors
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(theta**exponents, head_dim, theta, scaling)
    return inv_freq


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1, but for YaRN its ``attention_factor``, or
    ``0.1 ln(factor) + 1`` (with ``mscale`` and ``mscale_all_dim``: their ratio of that
    form), as Hugging Face's ``_compute_yarn_parameters``."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(pos_freqs: torch.Tensor, head_dim: int, theta: float,
                   scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies above ``beta_fast`` rotations over the original context kept,
    those below ``beta_slow`` divided by ``factor``, a linear ramp between (its ends
    rounded out where ``truncate``, the default), written as Hugging Face's."""
    factor = scaling["factor"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth
    interpolation in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout (pairs ``i`` and ``i + D/2``).

    Invariant: ``cos_sin_cache[p] = [cos(p f), cos(p f), -sin(p f), sin(p f)]`` (each part
    ``D/2`` wide; each times ``rope_attention_factor``, YaRN's) for every position ``p <
    max_positions``, computed once in float32 and stored in the model dtype, so a forward
    pass only indexes it (``cos_sin``) and each layer only multiplies (``apply_rotary``).
    The signed, duplicated layout turns the rotation into ``x * cos + swap_halves(x) * sin``
    over the full head::

        x:               | x1        | x2        |
        swap_halves(x):  | x2        | x1        |
        result:          | x1 c - x2 s | x2 c + x1 s |
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        factor = rope_attention_factor(scaling)
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        cache = torch.cat((cos, cos, -sin, sin), dim=-1).to(dtype=dtype, device=device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.head_dim = head_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each ``[T, 1, D]``, for the positions of a batch's tokens."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).split(self.head_dim, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by ``cos, sin [T, 1, D]`` from ``RotaryEmbedding.cos_sin``
    (q and k heads can go together). Bit-identical to the textbook "rotate half" form:
    ``x1 * c + x2 * (-s)`` is ``x1 * c - x2 * s`` exactly."""
    swapped = x.roll(x.shape[-1] // 2, dims=-1)
    return (x * cos).add_(swapped * sin)
