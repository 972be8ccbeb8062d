"""Mixtral: Mistral's attention (a sliding window on every layer, where the config has one)
with a mixture of experts, each ``intermediate_size`` wide, the top-k weights always
renormalised. Its checkpoint names the MoE block ``block_sparse_moe`` and an expert's
projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down): read under transformers' Qwen
names. (llama.cpp's converter writes Mixtral as ``llama`` with experts: not read here.)"""

import re

from tokenmill.models.families.qwen3_moe import MoeForCausalLM, Weights
from tokenmill.models.family import ModelFamily

_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_NAME = re.compile(r"\.block_sparse_moe\.(?:(experts\.\d+)\.(w[123])|gate)\.")


def _qwen_name(name: str) -> str:
    """``...block_sparse_moe.experts.3.w1.weight`` -> ``...mlp.experts.3.gate_proj.weight``,
    ``...block_sparse_moe.gate.weight`` -> ``...mlp.gate.weight``."""
    def rename(match: re.Match) -> str:
        expert, projection = match.groups()
        return (".mlp.gate." if expert is None
                else f".mlp.{expert}.{_PROJECTIONS[projection]}.")
    return _MIXTRAL_NAME.sub(rename, name)


class MixtralForCausalLM(MoeForCausalLM):
    def load_weights(self, weights: Weights) -> None:
        super().load_weights((_qwen_name(name), tensor) for name, tensor in weights)


FAMILY = ModelFamily("MixtralForCausalLM", None, window_on_every_layer=True, moe=True)
MODEL = MixtralForCausalLM
