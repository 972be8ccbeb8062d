"""The architecture hyper-parameters of a Llama-family model, from either source format.

``ModelConfig`` is built from a Hugging Face ``config.json`` dict (``from_hf_dict``) or from
GGUF metadata (``from_gguf_metadata``). Invariant: an instance describes a model this package
can run; anything it cannot (an unknown rope type, a non-SiLU activation, heads that do not
divide) raises ``ModelLoadError`` while building it, never later in the forward pass.

``rope_scaling`` is ``None`` (plain RoPE) or a dict with a ``rope_type`` of:

- ``"linear"``: ``factor`` (positions are divided by it);
- ``"llama3"``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings`` (Llama 3.1+ frequency smoothing);
- ``"freq_factors"``: ``factors``, one divisor per frequency (what a GGUF file stores in its
  ``rope_freqs`` tensor in place of the llama3 parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")

# GGUF ``general.architecture`` -> the Hugging Face architecture name it corresponds to.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q, k and v projections (Qwen2; Llama with attention_bias)
    o_proj_bias: bool = False  # bias on the output projection (Llama with attention_bias)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope scaling type {rope_type!r} "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json`` (transformers 4.x and 5.x rope layouts)."""
        archs = d.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json names no architecture ('architectures' is empty)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r} (only 'silu' is supported)")
        if d.get("mlp_bias"):
            raise ModelLoadError("unsupported config: mlp_bias = true")
        try:
            num_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            theta, scaling = _hf_rope(d)
            qwen2 = archs[0] == "Qwen2ForCausalLM"
            return cls(
                architecture=archs[0],
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=qwen2 or bool(d.get("attention_bias", False)),
                o_proj_bias=not qwen2 and bool(d.get("attention_bias", False)),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks the required key {e.args[0]!r}") from None

    @classmethod
    def from_gguf_metadata(
        cls, meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]
    ) -> ModelConfig:
        """Build from GGUF key/values and the tensors' shapes (torch order: rows first).

        Tied embeddings are recognised by the absence of ``output.weight``; a ``rope_freqs``
        tensor is not read here (the loader turns it into a ``freq_factors`` rope_scaling).
        """
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported GGUF architecture {arch!r} "
                f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
            )

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"GGUF metadata lacks the required key '{arch}.{key}'")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        scaling = None
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        embd_shape = tensor_shapes.get("token_embd.weight")
        if embd_shape is None:
            raise ModelLoadError("GGUF file has no token_embd.weight tensor")
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=int(meta.get(f"{arch}.vocab_size") or embd_shape[0]),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            o_proj_bias="blk.0.attn_output.bias" in tensor_shapes,
        )

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's paged KV cache: ``[2 (k, v), num_blocks, block_size, kv_heads, D]``."""
        return (2, num_blocks, block_size, self.num_key_value_heads, self.head_dim)


def _hf_rope(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` pair."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}
