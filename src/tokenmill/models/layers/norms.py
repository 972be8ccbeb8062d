"""RMSNorm, and QK-norm (an RMSNorm over each q and k head of a fused qkv row)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers.ops import LayerOps


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, computed in float32,
    by ``ops.rms_norm`` (see ``layers.ops``)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 ops: LayerOps):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.eps = eps
        self.rms_norm_op = ops.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms_norm_op(x, self.weight, self.eps)


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
