"""The Llama decoder (also Qwen2: the same graph with a bias on q, k and v).

``forward`` computes the hidden states of a ragged batch of new tokens against the paged
KV cache; ``compute_logits`` projects only the rows the caller samples from. Parameter
names follow Hugging Face's (``model.layers.N.self_attn...``) except for two fused
projections, filled shard by shard by ``load_weights``::

    qkv_proj.weight rows:     | q_proj (heads*D) | k_proj (kv*D) | v_proj (kv*D) |
    gate_up_proj.weight rows: | gate_proj (I)    | up_proj (I)   |
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.kernels import NativeKernels
from tokenmill.models.attention import AttentionBackend, AttentionPlan
from tokenmill.models.attention_metadata import AttentionMetadata
from tokenmill.models.attention_native import NativeAttention
from tokenmill.models.attention_sdpa import SdpaAttention
from tokenmill.models.config import ModelConfig
from tokenmill.models.gguf_blocks import FileRows
from tokenmill.models.layer_ops import LayerOps, layer_ops
from tokenmill.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from tokenmill.models.weight_formats import PackedWeight, WeightFormat

# Hugging Face projection name -> (our fused projection, shard index in it).
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Checkpoint entries that are not weights (precomputed rotary tables in old checkpoints).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    """``residual + o_proj(attention(qkv_proj(x)))``, the attention by the model's
    ``AttentionBackend`` (shared by its layers)."""

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

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        attn = self.attention(self.qkv_proj(x), cos, sin, kv_cache, plan)
        return self.o_proj.forward_add(attn, residual)


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
                            weight_format)

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
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention: AttentionBackend, ops: LayerOps,
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
            LlamaDecoderLayer(cfg, dtype, device, attention, ops, weight_format)
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 causal LM over a paged KV cache (one cache tensor per layer).

    Built for its kernels: ``kernels`` (the engine's native ones, None: PyTorch's) fix
    its attention backend and layer ops, ``weight_format`` (``choose_weight_format``'s;
    None: plain weights) its projections' and output head's format; neither changes
    afterwards."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 kernels: NativeKernels | None = None,
                 weight_format: WeightFormat | None = None):
        super().__init__()
        self.config = config
        self.attention = _attention_backend(config, dtype, kernels)
        self.model = LlamaModel(config, dtype, device, self.attention, layer_ops(kernels),
                                weight_format)
        self.weight_format = weight_format
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, dtype, device,
                        None if weight_format is None else weight_format.head)
        )
        self.packed_tied_head: PackedWeight | None = None
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        inter = config.intermediate_size
        self._shard_rows = {
            "qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
            "gate_up_proj": [(0, inter), (inter, 2 * inter)],
        }

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor: ``[2, num_blocks, block_size, kv_heads, D]``."""
        return self.config.kv_cache_shape(num_blocks, block_size)

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
        plan = self.attention.plan(attn_metadata, kv_caches[0].shape[1])
        cos, sin = self.model.rotary_emb.cos_sin(positions)
        h = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, plan)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """Logits ``[N, V]`` for the hidden rows ``[N, H]`` to sample from: float32, or with
        ``widen=False`` the output head's own dtype (for a caller that widens only where it
        computes)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.packed_tied_head is not None:
            logits = self.packed_tied_head(hidden)
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        return logits.float() if widen else logits

    def pack(self) -> None:
        """Convert every projection to the model's weight format (see ``weight_formats``);
        call once, after ``load_weights``. The output head takes the format's ``head``; a
        tied one gets a packed copy of the embedding, which the token lookup still needs."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is None and self.weight_format is not None:
            self.packed_tied_head = self.weight_format.head.pack(
                self.model.embed_tokens.weight.data, None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | FileRows]]) -> None:
        """Copy Hugging Face-named tensors into the parameters (cast to their dtype/device).
        A GGUF file's rows (``FileRows``) are dequantized into the parameter, and a
        projection (``Linear``) also keeps them, for its weight format.

        Raises ``ModelLoadError`` on an unknown name, a shape mismatch, or when some
        parameter (or shard of a fused one) received no tensor.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        seen: set[str] = set()
        for name, tensor in weights:
            tied_head = self.lm_head is None and name.startswith("lm_head.")
            if tied_head or name.endswith(IGNORED_SUFFIXES):
                continue
            target, shard = _fused_name(name)
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"unexpected weight {name!r} for {self.config.architecture}")
            dst, lo = param.data, 0
            if shard is not None:
                lo, hi = self._shard_rows[target.split(".")[-2]][shard]
                dst = dst[lo:hi]
            if dst.shape != tensor.shape:
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            if isinstance(tensor, FileRows):
                module = modules[target.rsplit(".", 1)[0]]
                if isinstance(module, Linear):
                    module.keep_file_rows(lo, tensor)
                tensor = tensor.dequantize()
            dst.copy_(tensor)
            seen.add(name)
        missing = sorted(self.expected_weight_names() - seen)
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ModelLoadError(f"missing weights: {', '.join(missing[:3])}{more}")

    def expected_weight_names(self) -> set[str]:
        """The Hugging Face names of every tensor ``load_weights`` must receive."""
        unfused = {fused: [hf for hf, (f, _) in PACKED_WEIGHTS.items() if f == fused]
                   for fused, _ in PACKED_WEIGHTS.values()}
        names = set()
        for name, _ in self.named_parameters():
            parts = name.split(".")
            for hf in unfused.get(parts[-2], [parts[-2]]):
                names.add(".".join([*parts[:-2], hf, parts[-1]]))
        return names


def _attention_backend(config: ModelConfig, dtype: torch.dtype,
                       kernels: NativeKernels | None) -> AttentionBackend:
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    if kernels is None:
        return SdpaAttention(*heads, dtype)
    return NativeAttention(kernels, *heads, dtype)


def _fused_name(hf_name: str) -> tuple[str, int | None]:
    """``model.layers.3.self_attn.k_proj.weight`` -> (``...qkv_proj.weight``, 1)."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in PACKED_WEIGHTS:
        fused, shard = PACKED_WEIGHTS[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return hf_name, None
