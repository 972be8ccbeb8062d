"""Qwen3-MoE: Qwen3's graph (QK-norm) with a mixture of experts in place of the dense MLP
on every layer the config routes (``layers.experts``); also the graph of the other MoE
families (``qwen2_moe``, ``mixtral``), which differ from it only in their
``ModelFamily``."""

from collections.abc import Iterable, Iterator

import torch

from tokenmill.models.attention.backend import AttentionBackend
from tokenmill.models.causal_lm import PagedCausalLM
from tokenmill.models.config import ModelConfig
from tokenmill.models.families.llama import LlamaForCausalLM, LlamaModel
from tokenmill.models.family import ModelFamily
from tokenmill.models.gguf.blocks import FileRows
from tokenmill.models.layers.experts import SparseMoeBlock, check_expert_weight
from tokenmill.models.layers.ops import LayerOps
from tokenmill.models.weights.formats import WeightFormat

Weights = Iterable[tuple[str, torch.Tensor | FileRows]]


class MoeModel(LlamaModel):
    """``LlamaModel`` whose routed layers' MLP is a ``SparseMoeBlock`` (the dense one built
    first is replaced before any weight is allocated: its parameters are ``torch.empty``)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attentions: list[AttentionBackend], ops: LayerOps,
                 weight_format: WeightFormat | None):
        super().__init__(cfg, dtype, device, attentions, ops, weight_format)
        for i, layer in enumerate(self.layers):
            if cfg.layer_is_moe(i):
                layer.mlp = SparseMoeBlock(cfg, dtype, device, ops, weight_format)


class MoeForCausalLM(LlamaForCausalLM):
    """A mixture-of-experts causal LM: the layers module by module (the native
    ``DecodeLayers`` has no experts), a checkpoint whose experts disagree with the config
    refused as its tensors are read (``check_expert_weight``), before the model is
    returned."""

    model_class = MoeModel

    def pack(self) -> None:
        PagedCausalLM.pack(self)

    def load_weights(self, weights: Weights) -> None:
        super().load_weights(self._checked(weights))

    def _checked(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor | FileRows]]:
        for name, tensor in weights:
            check_expert_weight(self.config, name, tuple(tensor.shape))
            yield name, tensor


FAMILY = ModelFamily("Qwen3MoeForCausalLM", "qwen3moe", qk_norm=True, moe=True,
                     gguf_norm_topk_prob=True)
MODEL = MoeForCausalLM
