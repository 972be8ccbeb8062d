"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q, k, v biases) with
experts beside a shared expert behind its sigmoid gate (``layers.experts``)."""

from tokenmill.models.families.qwen3_moe import MoeForCausalLM
from tokenmill.models.family import ModelFamily

FAMILY = ModelFamily("Qwen2MoeForCausalLM", "qwen2moe", qkv_bias=True, moe=True)
MODEL = MoeForCausalLM
