"""Building blocks of a decoder layer: Linear, RMSNorm, QK-norm, rotary embedding, gated
MLP (SiLU or tanh-GELU gate).

Parameters are created uninitialised (``torch.empty``): every one of them is overwritten by
the loader, and skipping random initialisation keeps loading a large model fast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.gguf_blocks import FileRows
from tokenmill.models.layer_ops import LayerOps
from tokenmill.models.weight_formats import PackedWeight, WeightFormat


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
        """Convert the loaded weight into ``weight_format``; call once, after loading."""
        if self.weight_format is None:
            return
        bias = None if self.bias is None else self.bias.data
        rows = [self.file_rows[first] for first in sorted(self.file_rows)]
        if sum(r.shape[0] for r in rows) == self.weight.shape[0]:
            self.packed = self.weight_format.pack_rows(self.weight.data, bias, rows)
        else:
            self.packed = self.weight_format.pack(self.weight.data, bias)
        self.file_rows = {}
        self.weight.data = self.weight.data.new_empty(0)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, computed in float32,
    by ``ops.rms_norm`` (see ``layer_ops``)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 ops: LayerOps):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.eps = eps
        self.rms_norm_op = ops.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms_norm_op(x, self.weight, self.eps)


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
    return inv_freq


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
    ``D/2`` wide) for every position ``p < max_positions``, computed once in float32 and
    stored in the model dtype, so a forward pass only indexes it (``cos_sin``) and each layer
    only multiplies (``apply_rotary``). The signed, duplicated layout turns the rotation into
    ``x * cos + swap_halves(x) * sin`` over the full head::

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
        cos, sin = angles.cos(), angles.sin()
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


def norm_qk(qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int,
            num_kv_heads: int) -> torch.Tensor:
    """``qkv [T, (heads + 2 kv_heads) D]`` with each q head normed by ``q_norm`` and each k
    head by ``k_norm`` (QK-norm, before rotary); v unchanged. PyTorch's RMSNorm: the heads
    are strided views of ``qkv``."""
    num_tokens, head_dim = qkv.shape[0], q_norm.weight.shape[0]
    q_size, k_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, k_size, k_size], dim=1)
    q = F.rms_norm(q.view(num_tokens, num_heads, head_dim), (head_dim,), q_norm.weight,
                   q_norm.eps)
    k = F.rms_norm(k.view(num_tokens, num_kv_heads, head_dim), (head_dim,), k_norm.weight,
                   k_norm.eps)
    return torch.cat((q.view(num_tokens, q_size), k.view(num_tokens, k_size), v), dim=1)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``x = [gate | up]`` (Gemma's gate)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


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
        gated = (self.weight_format.pack_silu_gated(self.weight.data)
                 if self._silu and self.weight_format is not None else None)
        if gated is None:
            super().pack()
            return
        self.packed, self.fused, self.file_rows = gated, True, {}
        self.weight.data = self.weight.data.new_empty(0)


class GatedMLP(nn.Module):
    """``residual + down(act(gate(x)) * up(x))`` with gate and up fused in one ``[2I, H]``
    projection (``GatedLinear``, which gates too); the gate by ``ops.silu_and_mul`` (see
    ``layer_ops``) or in the projection's kernel, or by ``gelu_tanh_and_mul`` with
    ``activation="gelu_pytorch_tanh"``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: LayerOps,
        weight_format: WeightFormat | None = None,
        activation: str = "silu",
    ):
        super().__init__()
        silu = activation == "silu"
        self.gate_up_proj = GatedLinear(hidden_size, intermediate_size, dtype, device,
                                        weight_format,
                                        ops.silu_and_mul if silu else gelu_tanh_and_mul, silu)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype, device,
                                weight_format)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_add(self.gate_up_proj(x), residual)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))``, no residual (for a norm after the MLP)."""
        return self.down_proj(self.gate_up_proj(x))
