"""Phi-3: Llama's graph with a sliding window on every layer, its checkpoint's qkv and
gate/up projections fused as this package fuses them."""

from tokenmill.models.families.llama import LlamaForCausalLM
from tokenmill.models.family import ModelFamily

FAMILY = ModelFamily("Phi3ForCausalLM", "phi3", fused_checkpoint=True,
                     window_on_every_layer=True,
                     gguf_layer_names=(("attn_qkv", "self_attn.qkv_proj"),
                                       ("ffn_up", "mlp.gate_up_proj")))
MODEL = LlamaForCausalLM
