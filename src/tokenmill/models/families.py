"""What sets each supported architecture apart from Llama, as data (no torch).

A ``ModelFamily`` is read where a difference matters: ``config.ModelConfig`` (which config
keys mean what), the model classes (QK-norm, checkpoint layout), ``gguf_loader`` (tensor
names, Q/K row order). Adding an architecture that is Llama's graph with such differences
is one entry of ``FAMILIES``; a different graph (Gemma 3) also gets its own model module,
named by ``registry``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelFamily:
    architecture: str  # Hugging Face ``architectures[0]``
    gguf_architecture: str | None  # llama.cpp's ``general.architecture``; None: no GGUF
    qkv_bias: bool = False  # q, k and v always carry a bias (Qwen2), whatever attention_bias
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    # The checkpoint stores qkv_proj and gate_up_proj fused (Phi-3), as this package does.
    fused_checkpoint: bool = False
    # llama.cpp's converter interleaves the rows of each Q and K head (its llama arch).
    gguf_permutes_qk: bool = False
    # Sliding window on every layer from ``sliding_window`` alone (Mistral, Phi-3), where
    # the config has no ``layer_types``.
    window_on_every_layer: bool = False
    gemma_norms: bool = False  # norms scale by (1 + weight), sqrt(hidden) embeddings
    # GGUF layer tensor kinds that name another Hugging Face module than Llama's
    # (``gguf_loader``'s table), as (GGUF kind, HF module) pairs.
    gguf_layer_names: tuple[tuple[str, str], ...] = ()


FAMILIES: dict[str, ModelFamily] = {
    f.architecture: f
    for f in (
        ModelFamily("LlamaForCausalLM", "llama", gguf_permutes_qk=True),
        ModelFamily("MistralForCausalLM", "llama", gguf_permutes_qk=True,
                    window_on_every_layer=True),
        ModelFamily("Qwen2ForCausalLM", "qwen2", qkv_bias=True),
        ModelFamily("Qwen3ForCausalLM", "qwen3", qk_norm=True),
        ModelFamily("Phi3ForCausalLM", "phi3", fused_checkpoint=True,
                    window_on_every_layer=True,
                    gguf_layer_names=(("attn_qkv", "self_attn.qkv_proj"),
                                      ("ffn_up", "mlp.gate_up_proj"))),
        ModelFamily("Gemma3ForCausalLM", "gemma3", qk_norm=True, gemma_norms=True,
                    gguf_layer_names=(("ffn_norm", "pre_feedforward_layernorm"),
                                      ("post_attention_norm", "post_attention_layernorm"),
                                      ("post_ffw_norm", "post_feedforward_layernorm"))),
    )
}

# GGUF ``general.architecture`` -> the family its files are read as (Mistral's files say
# "llama": llama.cpp converts it as Llama, window and all dropped).
GGUF_FAMILIES: dict[str, ModelFamily] = {
    "llama": FAMILIES["LlamaForCausalLM"],
    "qwen2": FAMILIES["Qwen2ForCausalLM"],
    "qwen3": FAMILIES["Qwen3ForCausalLM"],
    "phi3": FAMILIES["Phi3ForCausalLM"],
    "gemma3": FAMILIES["Gemma3ForCausalLM"],
}
