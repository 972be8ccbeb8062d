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

Head size 256 (Gemma 3's) runs on the native decode kernel (its register-blocked AVX2
or AVX-512 path); the native prefill kernel has no such head size, so prefills take SDPA
(``NativeAttention`` chooses by the kernels' capabilities).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import NativeKernels
from tokenmill.models.attention.backend import AttentionBackend, AttentionPlan
from tokenmill.models.causal_lm import PagedCausalLM
from tokenmill.models.config import FULL, SLIDING, ModelConfig
from tokenmill.models.families.llama import LlamaAttention, LlamaModel
from tokenmill.models.family import ModelFamily
from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.norms import RMSNorm, norm_qk
from tokenmill.models.layers.ops import LayerOps
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.weights.formats import WeightFormat


class Gemma3Attention(LlamaAttention):
    """``o_proj(attention(qk_norm(qkv_proj(x))))``: ``LlamaAttention``'s projections and
    q/k norms (Gemma 3's config always norms them), without the residual (a norm follows)."""

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


class Gemma3Model(LlamaModel):
    """``LlamaModel`` with Gemma 3's layers, its embedding scale (``sqrt(hidden)``) and a
    second rotary table for the sliding layers (``rotary_emb_local``)."""

    decoder_layer = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attentions: list[AttentionBackend], ops: LayerOps,
                 weight_format: WeightFormat | None):
        super().__init__(cfg, dtype, device, attentions, ops, weight_format)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5, dtype=dtype,
                                                         device=device), persistent=False)
        self.rotary_emb_local = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings,
            cfg.sliding_rope_theta or cfg.rope_theta, None, dtype, device,
        )


class Gemma3ForCausalLM(PagedCausalLM):
    """Gemma 3 (text) causal LM over a paged KV cache (see ``PagedCausalLM``)."""

    model_class = Gemma3Model

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 kernels: NativeKernels | None = None,
                 weight_format: WeightFormat | None = None):
        super().__init__(config, dtype, device, kernels, weight_format)
        self._sliding_layer = [config.layer_window(i) is not None
                               for i in range(config.num_hidden_layers)]

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Norm weights ``w`` -> ``1 + w`` (computed in float32, as Hugging Face's)."""
        return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[torch.Tensor], plans: list[AttentionPlan]) -> torch.Tensor:
        rotary = {FULL: self.model.rotary_emb.cos_sin(positions),
                  SLIDING: self.model.rotary_emb_local.cos_sin(positions)}
        h = self.model.embed_tokens(input_ids) * self.model.embed_scale
        for layer, kv_cache, plan, sliding in zip(self.model.layers, kv_caches, plans,
                                                  self._sliding_layer, strict=True):
            cos, sin = rotary[SLIDING if sliding else FULL]
            h = layer(h, cos, sin, kv_cache, plan)
        return h


FAMILY = ModelFamily("Gemma3ForCausalLM", "gemma3", qk_norm=True, gemma_norms=True,
                     gguf_layer_names=(("ffn_norm", "pre_feedforward_layernorm"),
                                       ("post_attention_norm", "post_attention_layernorm"),
                                       ("post_ffw_norm", "post_feedforward_layernorm")))
MODEL = Gemma3ForCausalLM
