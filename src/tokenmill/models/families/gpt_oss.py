"""gpt-oss: the Llama decoder with biases on every attention projection, a learned sink
per attention head (``attention.sinks``), sliding-window layers alternating with full
ones (``layer_types``), YaRN rotary, and a mixture of experts whose router has a bias and
whose experts have biases and a clamped SwiGLU gate.

Routing is transformers' (``GptOssTopKRouter``): ``torch.topk`` of the router's logits,
then a softmax over the k chosen ones. The checkpoint stores each layer's experts as 3-D
tensors, transposed and with gate and up columns interleaved (``gate_up_proj [E, H, 2I]``:
column ``2i`` gate ``i``, ``2i + 1`` up ``i``; ``down_proj [E, I, H]``): ``load_weights``
reads them as per-expert ``gate_proj``, ``up_proj`` and ``down_proj`` rows."""

from collections.abc import Iterator

import torch
from torch import nn

from tokenmill.kernels import NativeKernels
from tokenmill.models.attention.backend import AttentionBackend, AttentionPlan
from tokenmill.models.attention.sinks import SinkAttention
from tokenmill.models.causal_lm import backends_by_window
from tokenmill.models.config import ModelConfig
from tokenmill.models.families.llama import LlamaAttention, LlamaModel
from tokenmill.models.families.qwen3_moe import MoeForCausalLM, Weights
from tokenmill.models.family import ModelFamily
from tokenmill.models.gguf.blocks import FileRows
from tokenmill.models.layers.experts import SparseMoeBlock
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.ops import LayerOps
from tokenmill.models.weights.formats import WeightFormat


class ClampedSwiGLUExpert(nn.Module):
    """``down((clamp(up, +-limit) + 1) g sigmoid(alpha g)) + down_bias`` with ``g`` the
    gate clamped below ``limit``, gate and up (with their biases) in one projection."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 weight_format: WeightFormat | None):
        super().__init__()
        width = cfg.moe_intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * width, True, dtype, device,
                                   weight_format)
        self.down_proj = Linear(width, cfg.hidden_size, True, dtype, device, weight_format)
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def project(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssMoeBlock(SparseMoeBlock):
    """``SparseMoeBlock`` with gpt-oss's router (a bias; top-k, then softmax) and
    experts."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 weight_format: WeightFormat | None):
        nn.Module.__init__(self)
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, True, dtype, device)
        self.experts = nn.ModuleList(ClampedSwiGLUExpert(cfg, dtype, device, weight_format)
                                     for _ in range(cfg.num_experts))
        self.shared_expert = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), experts


class GptOssAttention(LlamaAttention):
    """``LlamaAttention`` (biases on q, k, v and o) whose backend takes the layer's
    ``sinks``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention: AttentionBackend, weight_format: WeightFormat | None):
        super().__init__(cfg, dtype, device, attention, weight_format)
        self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads, dtype=dtype,
                                              device=device))

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        out = self.attention(self.qkv_proj(x), cos, sin, kv_cache, plan, self.sinks)
        return self.o_proj.forward_add(out, residual)


class GptOssModel(LlamaModel):
    """``LlamaModel`` with gpt-oss's attention and experts in every layer (the modules
    built first are replaced before any weight is allocated)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attentions: list[AttentionBackend], ops: LayerOps,
                 weight_format: WeightFormat | None):
        super().__init__(cfg, dtype, device, attentions, ops, weight_format)
        for layer, attention in zip(self.layers, attentions, strict=True):
            layer.self_attn = GptOssAttention(cfg, dtype, device, attention, weight_format)
            layer.mlp = GptOssMoeBlock(cfg, dtype, device, weight_format)


class GptOssForCausalLM(MoeForCausalLM):
    """gpt-oss over ``SinkAttention`` (PyTorch's ops: the native kernels have no sinks)."""

    model_class = GptOssModel

    @staticmethod
    def attention_backends(config: ModelConfig, dtype: torch.dtype,
                           kernels: NativeKernels | None) -> list[AttentionBackend]:
        heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        return backends_by_window(config, lambda window: SinkAttention(
            *heads, dtype, config.attention_scale, window))

    def load_weights(self, weights: Weights) -> None:
        super().load_weights(_per_expert(weights))


def _per_expert(weights: Weights) -> Iterator[tuple[str, torch.Tensor | FileRows]]:
    """Transformers' gpt-oss names -> this package's: the router as ``mlp.gate``, each 3-D
    expert tensor as per-expert ``gate_proj``, ``up_proj``, ``down_proj`` (see the module
    docstring)."""
    for name, tensor in weights:
        head, _, tail = name.partition(".mlp.experts.")
        if not tail:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        prefix = f"{head}.mlp.experts"
        kind = tail.removesuffix("_bias")
        suffix = "bias" if tail.endswith("_bias") else "weight"
        for expert, values in enumerate(tensor):
            if suffix == "weight":
                values = values.t()  # [in, out] -> [out, in]
            if kind == "gate_up_proj":
                yield f"{prefix}.{expert}.gate_proj.{suffix}", values[0::2].contiguous()
                yield f"{prefix}.{expert}.up_proj.{suffix}", values[1::2].contiguous()
            else:
                yield f"{prefix}.{expert}.down_proj.{suffix}", values.contiguous()


FAMILY = ModelFamily("GptOssForCausalLM", None, moe=True)
MODEL = GptOssForCausalLM
