"""The Llama decoder, also the graph of the families that differ from it only in their
``ModelFamily`` (``mistral``, ``qwen2``, ``qwen3``, ``phi3``).

``forward`` computes the hidden states of a ragged batch of new tokens against the paged
KV cache; ``compute_logits`` projects only the rows the caller samples from (see
``causal_lm`` for the weights' names and loading).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels.signatures import DecodeLayers
from tokenmill.models.attention.backend import AttentionBackend, AttentionPlan
from tokenmill.models.attention.native import NativeAttention, NativePrefillPlan
from tokenmill.models.causal_lm import PagedCausalLM
from tokenmill.models.config import ModelConfig
from tokenmill.models.family import ModelFamily
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.norms import RMSNorm, norm_qk
from tokenmill.models.layers.ops import TORCH_LAYER_OPS, LayerOps
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.weights.formats import PackedWeight, StackedRowsWeight, WeightFormat
from tokenmill.models.weights.native_weights import KernelCall, KernelWeight


class LlamaAttention(nn.Module):
    """``residual + o_proj(attention(qkv_proj(x)))``, the attention by the model's
    ``AttentionBackend`` (shared by the layers of its window); with ``cfg.qk_norm``
    (Qwen3), q and k are normed per head before rotary."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention: AttentionBackend, weight_format: WeightFormat | None):
        super().__init__()
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.attention_bias, dtype,
                               device, weight_format)
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, device,
                             weight_format)
        self.attention = attention
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # PyTorch's RMSNorm over strided heads (see norm_qk): no native op
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, TORCH_LAYER_OPS)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, TORCH_LAYER_OPS)
            self.heads = (cfg.num_attention_heads, cfg.num_key_value_heads)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.qk_norm:
            qkv = norm_qk(qkv, self.q_norm, self.k_norm, *self.heads)
        return self.o_proj.forward_add(self.attention(qkv, cos, sin, kv_cache, plan), residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention: AttentionBackend, ops: LayerOps,
                 weight_format: WeightFormat | None):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, ops)
        self.self_attn = LlamaAttention(cfg, dtype, device, attention, weight_format)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, ops)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device, ops,
                            weight_format, cfg.hidden_act)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(h), h, cos, sin, kv_cache, plan)
        return self.mlp(self.post_attention_layernorm(h), h)


class LlamaModel(nn.Module):
    """Embedding, ``decoder_layer`` per attention backend, final norm."""

    decoder_layer = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attentions: list[AttentionBackend], ops: LayerOps,
                 weight_format: WeightFormat | None):
        super().__init__()
        self.embed_tokens = nn.utils.skip_init(
            nn.Embedding, cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device
        )
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
            dtype, device,
        )
        self.layers = nn.ModuleList(
            self.decoder_layer(cfg, dtype, device, attention, ops, weight_format)
            for attention in attentions
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)


class LlamaForCausalLM(PagedCausalLM):
    """Llama / Qwen2 / Qwen3 / Mistral / Phi-3 causal LM over a paged KV cache (see
    ``PagedCausalLM``). After ``pack``, ``decode_layers`` (the native kernels' fused decode
    call, where ``native_decode_layers`` builds it) runs a batch of decodes alone through
    every layer in one call, and a batch with prompt tokens too where the native prefill
    attention takes them; setting it to None runs them layer module by layer module (the
    same ops, the same outputs)."""

    model_class = LlamaModel
    decode_layers = None

    def pack(self) -> None:
        super().pack()
        self.decode_layers = native_decode_layers(self)

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[torch.Tensor], plans: list[AttentionPlan]) -> torch.Tensor:
        cos, sin = self.model.rotary_emb.cos_sin(positions)
        h = self.model.embed_tokens(input_ids)
        shared = plans[0]  # with decode_layers, every layer's (one attention backend)
        if self.decode_layers is not None and shared.prefill is None:
            return self.decode_layers.run(h, cos, sin, kv_caches, shared.slot_mapping,
                                          shared.decode.block_tables, shared.decode.seq_lens,
                                          shared.decodes_one_per_sequence)
        if self.decode_layers is not None and isinstance(shared.prefill, NativePrefillPlan):
            decode, prefill = shared.decode, shared.prefill
            return self.decode_layers.run_mixed(
                h, cos, sin, kv_caches, shared.slot_mapping, shared.decode_token_idx,
                None if decode is None else decode.block_tables,
                None if decode is None else decode.seq_lens, prefill.block_tables,
                prefill.query_ranges, prefill.seq_lens, prefill.blocks, prefill.renumbered)
        for layer, kv_cache, plan in zip(self.model.layers, kv_caches, plans, strict=True):
            h = layer(h, cos, sin, kv_cache, plan)
        return h


def native_decode_layers(model: LlamaForCausalLM) -> DecodeLayers | None:
    """The native kernels' ``DecodeLayers`` (``NativeKernels.decode_layers``, where
    ``capabilities.decode_layers``) bound to the packed model's layers, or None where a
    layer takes a step it does not: an attention backend other than the native kernels'
    (or more than one: every layer must share one plan), QK-norm, a norm or gate by
    PyTorch's ops (or GELU's), or a projection whose packed weight is not kernel calls
    (``KernelWeight``, or a ``StackedRowsWeight`` of them)."""
    kernels, attentions, layers = model.kernels, model.attentions, model.model.layers
    if (kernels is None or not kernels.capabilities.decode_layers
            or len(attentions) != 1 or not isinstance(attentions[0], NativeAttention)
            or model.config.qk_norm
            or any(type(layer) is not LlamaDecoderLayer for layer in layers)):
        return None
    attention = attentions[0]
    norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in layers]
    linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj) for layer in layers]
    if not (all(norm.rms_norm_op is kernels.rms_norm for pair in norms for norm in pair)
            and all(_kernel_calls(p.packed) for four in linears for p in four)
            and all(four[2].fused or four[2].act_and_mul is kernels.silu_and_mul
                    for four in linears)):
        return None
    stack = kernels.decode_layers(model.config.rms_norm_eps, attention.num_heads,
                                  attention.num_kv_heads, attention.head_dim, attention.scale,
                                  attention.decode.window)
    for (input_norm, post_norm), four in zip(norms, linears, strict=True):
        stack.add_layer(input_norm.weight.data, post_norm.weight.data, not four[2].fused)
        for projection in four:
            first, *parts = _kernel_calls(projection.packed)
            stack.add_linear(first.op, first.weight_args, first.trailing_args)
            for call in parts:
                stack.add_linear_part(call.op, call.weight_args, call.trailing_args)
    return stack


def _kernel_calls(packed: PackedWeight) -> list[KernelCall]:
    """The kernel calls that compute ``packed``: its own, or one per part of a weight packed
    in parts (``StackedRowsWeight``); none where some part is not one kernel call."""
    parts = packed.parts if isinstance(packed, StackedRowsWeight) else [packed]
    if not all(isinstance(part, KernelWeight) for part in parts):
        return []
    return [part.kernel_call() for part in parts]


FAMILY = ModelFamily("LlamaForCausalLM", "llama", gguf_permutes_qk=True)
MODEL = LlamaForCausalLM
