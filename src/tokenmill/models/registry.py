"""The supported model families: architecture name (a config.json's ``architectures``, or
a GGUF file's ``general.architecture``) -> its ``ModelFamily`` and the class that runs it.

``FAMILIES`` lists the family modules (``families/``), one line each; everything else here
is derived from it.
"""

from __future__ import annotations

from tokenmill.models.causal_lm import PagedCausalLM
from tokenmill.models.families import (
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from tokenmill.models.family import ModelFamily

FAMILIES = (
    llama,
    mistral,
    qwen2,
    qwen3,
    phi3,
    gemma3,
    qwen3_moe,
    qwen2_moe,
    mixtral,
    gpt_oss,
)
MODEL_REGISTRY: dict[str, type[PagedCausalLM]] = {
    module.FAMILY.architecture: module.MODEL for module in FAMILIES}
HF_FAMILIES: dict[str, ModelFamily] = {module.FAMILY.architecture: module.FAMILY
                                       for module in FAMILIES}
GGUF_FAMILIES: dict[str, ModelFamily] = {
    module.FAMILY.gguf_architecture: module.FAMILY for module in FAMILIES
    if module.FAMILY.gguf_architecture is not None}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_model_class(architecture: str) -> type[PagedCausalLM]:
    """The model class for ``architecture``; a ValueError naming the supported ones if none."""
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(
            f"unsupported model architecture {architecture!r} "
            f"(supported: {', '.join(supported_architectures())})"
        )
    return cls
