"""Qwen3: Llama's graph with an RMSNorm over each q and k head before rotary (QK-norm)."""

from tokenmill.models.families.llama import LlamaForCausalLM
from tokenmill.models.family import ModelFamily

FAMILY = ModelFamily("Qwen3ForCausalLM", "qwen3", qk_norm=True)
MODEL = LlamaForCausalLM
