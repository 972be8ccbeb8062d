"""The Gemma 3 text decoder (``Gemma3ForCausalLM``), over the paged KV cache.

Its graph differs from Llama's (``llama``) in the layer, so it has its own::

    h = h + post_attention_layernorm(o_proj(attention(qk_norm(qkv_proj(input_layernorm(h))))))
    h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

- every RMSNorm scales by ``1 + weight``: ``convert_weight`` adds the 1 once at load, so
  the norms are plain ``RMSNorm``s (and the native op where the engine has it);
- the embeddings are scaled by ``sqrt(hidden)`` (rounded to the model dtype, as
  Hugging Face's); the output head is tied to them;
- the MLP gate is tanh-GELU; q . k is scaled by ``query_pre_attn_scalar ** -0.5``;
- sliding-window layers interleave with full ones (``ModelConfig.layer_types``), each
  kind with its own rotary base (the sliding ones ``sliding_rope_theta``, unscaled).

Head size 256 (Gemma 3's) runs on the native decode kernel (its AVX2 register-blocked
path); the native prefill kernel has no such head size, so prefills take SDPA
(``NativeAttention`` chooses by the kernels' capabilities).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import NativeKernels
from tokenmill.models.attention import AttentionBackend, AttentionPlan
from tokenmill.models.attention_metadata import AttentionMetadata
from tokenmill.models.causal_lm import PagedCausalLM
from tokenmill.models.config import FULL, SLIDING, ModelConfig
from tokenmill.models.layer_ops import TORCH_LAYER_OPS, LayerOps, layer_ops
from tokenmill.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, norm_qk
from tokenmill.models.weight_formats import WeightFormat


class Gemma3Attention(nn.Module):
    """``o_proj(attention(qk_norm(qkv_proj(x))))``, no residual (a norm follows)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention: AttentionBackend, weight_format: WeightFormat | None):
        super().__init__()
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.attention_bias, dtype,
                               device, weight_format)
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, device,
                             weight_format)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, TORCH_LAYER_OPS)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, TORCH_LAYER_OPS)
        self.heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
        self.attention = attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        qkv = norm_qk(self.qkv_proj(x), self.q_norm, self.k_norm, *self.heads)
        return self.o_proj(self.attention(qkv, cos, sin, kv_cache, plan))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention: AttentionBackend, ops: LayerOps,
                 weight_format: WeightFormat | None):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device, ops)
        self.self_attn = Gemma3Attention(cfg, dtype, device, attention, weight_format)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device, ops)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype, device, ops)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, dtype, device, ops, weight_format,
                            cfg.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype, device, ops)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, plan)
        h = h + self.post_attention_layernorm(attn)
        mlp = self.mlp.project(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attentions: list[AttentionBackend], ops: LayerOps,
                 weight_format: WeightFormat | None):
        super().__init__()
        self.embed_tokens = nn.utils.skip_init(
            nn.Embedding, cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device
        )
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5, dtype=dtype,
                                                         device=device), persistent=False)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
            dtype, device,
        )
        self.rotary_emb_local = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings,
            cfg.sliding_rope_theta or cfg.rope_theta, None, dtype, device,
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, dtype, device, attention, ops, weight_format)
            for attention in attentions
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)


class Gemma3ForCausalLM(PagedCausalLM):
    """Gemma 3 (text) causal LM over a paged KV cache (see ``PagedCausalLM``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 kernels: NativeKernels | None = None,
                 weight_format: WeightFormat | None = None):
        super().__init__(config, dtype, device, kernels, weight_format)
        self.model = Gemma3Model(config, dtype, device, self.layer_attentions,
                                 layer_ops(kernels), weight_format)
        self._sliding_layer = [config.layer_window(i) is not None
                               for i in range(config.num_hidden_layers)]

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Norm weights ``w`` -> ``1 + w`` (computed in float32, as Hugging Face's)."""
        return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states ``[T, H]`` (after the final norm) for the batch's ``T`` new tokens.

        Also writes each layer's new keys/values into ``kv_caches`` at the metadata's slots.
        """
        assert len(kv_caches) == len(self.model.layers), "one KV cache tensor per layer"
        plans = self.layer_plans(attn_metadata, kv_caches[0].shape[1])
        rotary = {FULL: self.model.rotary_emb.cos_sin(positions),
                  SLIDING: self.model.rotary_emb_local.cos_sin(positions)}
        h = self.model.embed_tokens(input_ids) * self.model.embed_scale
        for layer, kv_cache, plan, sliding in zip(self.model.layers, kv_caches, plans,
                                                  self._sliding_layer, strict=True):
            cos, sin = rotary[SLIDING if sliding else FULL]
            h = layer(h, cos, sin, kv_cache, plan)
        return self.model.norm(h)
