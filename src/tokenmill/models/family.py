"""What sets a supported architecture apart from Llama, as data (no torch).

A ``ModelFamily`` is read where a difference matters: ``config.ModelConfig`` (which config
keys mean what), the model classes (QK-norm, checkpoint layout), ``gguf.loader`` (tensor
names, Q/K row order). Each family's file in ``families/`` holds its record beside the
model class that runs it, and ``registry`` lists the files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelFamily:
    architecture: str  # Hugging Face ``architectures[0]``
    # llama.cpp's ``general.architecture`` whose files are read as this family; None: none
    # (Mistral's files say "llama": llama.cpp converts it as Llama, window and all dropped)
    gguf_architecture: str | None
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
    # (``gguf.loader``'s table), as (GGUF kind, HF module) pairs.
    gguf_layer_names: tuple[tuple[str, str], ...] = ()
    # A mixture of experts in the MLPs (``layers.experts``): the config must name them.
    moe: bool = False
    # Whether a GGUF file's routing renormalises the top-k weights: llama.cpp decides it by
    # architecture (true for qwen3moe, false for qwen2moe); a file does not say.
    gguf_norm_topk_prob: bool = False

