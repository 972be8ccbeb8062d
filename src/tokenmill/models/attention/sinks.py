"""Paged attention with a learned sink per head (gpt-oss): each head's softmax runs over
its scores and one more logit, the layer's ``sinks[h]``, whose column is then dropped, so
a head may give its keys less than all of their weight::

    p = softmax([q . k_0 s, ..., q . k_{n-1} s, sinks[h]])[:n];   out = p @ v

``SinkAttention`` plans as ``SdpaAttention`` (windows, blocks, masks) and computes each
decode batch and prefill sequence eagerly, in transformers' order of operations (its
``eager_attention_forward`` for gpt-oss: scores times the scale, the mask added, the sink
column appended, the row's maximum subtracted, softmax, the sink dropped); the sinks are
the layer's, given with each call.
"""

from __future__ import annotations

import torch

from tokenmill.models.attention.backend import AttentionPlan
from tokenmill.models.attention.sdpa import (
    PrefillSeq,
    SdpaAttention,
    SdpaDecodePlan,
    decode_operands,
    prefill_keys_values,
)


class SinkAttention(SdpaAttention):
    """``SdpaAttention``'s plans and KV store; the attention with the layer's sinks."""

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor,
                 plan: AttentionPlan[SdpaDecodePlan, list[PrefillSeq]],
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert sinks is not None, "a layer with sinks gives them"
        q, k, v = self.rotate_and_store(qkv, cos, sin, kv_cache, plan)
        if plan.prefill is None:
            return self._decode(q, kv_cache, plan.decode, sinks)
        out = q.new_empty(q.shape[0], self.q_size)
        if plan.decode is not None:
            idx = plan.decode_token_idx
            out.index_copy_(0, idx, self._decode(q[idx], kv_cache, plan.decode, sinks))
        for seq in plan.prefill:
            rows = slice(seq.start, seq.end)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache, seq, sinks)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: SdpaDecodePlan,
                sinks: torch.Tensor) -> torch.Tensor:
        num_seqs = q.shape[0]
        q, k, v = decode_operands(q, kv_cache, plan)  # [Bd, kvh, G, D], [Bd, kvh, L, D]
        out = _attend(q, k, v, plan.mask, sinks.view(1, *q.shape[1:3], 1), self.scale)
        return out.reshape(num_seqs, self.q_size)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, seq: PrefillSeq, sinks: torch.Tensor) -> torch.Tensor:
        keys, values = prefill_keys_values(k, v, kv_cache, seq, q.dtype)
        group = self.num_heads // self.num_kv_heads
        keys, values = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (keys, values))
        mask = seq.mask
        if mask is None:  # plain causal over the sequence's own new keys
            mask = torch.full((q.shape[0], keys.shape[1]), float("-inf"), dtype=q.dtype,
                              device=q.device).triu_(1)
        out = _attend(q.transpose(0, 1), keys, values, mask, sinks.view(-1, 1, 1), self.scale)
        return out.transpose(0, 1).reshape(q.shape[0], self.q_size)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax([q k^T scale + mask | sinks])[..., :-1] @ v`` over the last two dims;
    ``sinks`` broadcast to the scores' leading dims with one column."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)
    return torch.matmul(probs[..., :-1].to(v.dtype), v)
