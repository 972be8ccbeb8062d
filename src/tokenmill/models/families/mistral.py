"""Mistral: Llama's graph with a sliding window on every layer."""

from tokenmill.models.families.llama import LlamaForCausalLM
from tokenmill.models.family import ModelFamily

FAMILY = ModelFamily("MistralForCausalLM", None, gguf_permutes_qk=True,
                     window_on_every_layer=True)
MODEL = LlamaForCausalLM
