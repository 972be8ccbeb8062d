"""Architecture name (as in a config.json's ``architectures``) -> the class that runs it."""

from __future__ import annotations

from torch import nn

from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_model_class(architecture: str) -> type[nn.Module]:
    """The model class for ``architecture``; a ValueError naming the supported ones if none."""
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(
            f"unsupported model architecture {architecture!r} "
            f"(supported: {', '.join(supported_architectures())})"
        )
    return cls
