"""Qwen2: Llama's graph with a bias on q, k and v."""

from tokenmill.models.families.llama import LlamaForCausalLM
from tokenmill.models.family import ModelFamily

FAMILY = ModelFamily("Qwen2ForCausalLM", "qwen2", qkv_bias=True)
MODEL = LlamaForCausalLM
