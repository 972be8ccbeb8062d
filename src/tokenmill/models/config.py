"""The architecture hyper-parameters of a supported model, from either source format.

``ModelConfig`` is built from a Hugging Face ``config.json`` dict (``from_hf_dict``) or from
GGUF metadata (``from_gguf_metadata``), given the supported families by architecture name
(``registry``'s); what each architecture's keys mean is its ``family.ModelFamily``.
Invariant: an instance describes a model this package can run; anything it cannot (an
unknown architecture or rope type, an activation other than SiLU or tanh-GELU, heads that
do not divide, a partial rotary) raises ``ModelLoadError`` while building it, never later
in the forward pass.

Sliding-window attention: ``layer_types[i]`` is ``"sliding_attention"`` where layer ``i``
attends to the last ``sliding_window`` positions only (a query at position ``p`` sees keys
``p - sliding_window < j <= p``, as Hugging Face's mask), ``"full_attention"`` elsewhere;
``layer_types`` is empty where every layer is full (and then ``sliding_window`` is None).

``rope_scaling`` is ``None`` (plain RoPE) or a dict with a ``rope_type`` of:

- ``"linear"``: ``factor`` (positions are divided by it);
- ``"llama3"``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings`` (Llama 3.1+ frequency smoothing);
- ``"freq_factors"``: ``factors``, one divisor per frequency (what a GGUF file stores in its
  ``rope_freqs`` tensor in place of the llama3 parameters);
- ``"yarn"``: ``factor``, ``original_max_position_embeddings``, optionally ``beta_fast``,
  ``beta_slow``, ``truncate``, ``attention_factor``, ``mscale``, ``mscale_all_dim`` (as
  Hugging Face's ``_compute_yarn_parameters``).

Mixture of experts (``num_experts > 0``, a ``ModelFamily.moe`` family): the MLP of every
layer but ``dense_mlp_layers`` routes each token to its top ``num_experts_per_tok`` of
``num_experts`` gated MLPs of ``moe_intermediate_size`` (``layers.experts``), beside a
shared one of ``shared_expert_intermediate_size`` where that is not 0 (Qwen2-MoE).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import ModelLoadError
from tokenmill.models.attention.kv_int8 import row_width
from tokenmill.models.family import ModelFamily

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    family: ModelFamily
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
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    sliding_window: int | None = None  # see the module docstring
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer; empty: all FULL
    hidden_act: str = "silu"  # the MLP gate's: "silu" or "gelu_pytorch_tanh" (Gemma)
    # Gemma 3: attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5), and
    # the sliding layers' own rotary base (None: rope_theta; they take no rope scaling).
    query_pre_attn_scalar: float | None = None
    sliding_rope_theta: float | None = None
    # Mixture of experts (see the module docstring); 0 experts: every MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0
    dense_mlp_layers: tuple[int, ...] = ()
    # gpt-oss's experts' gate: ``(clamp(up, +-limit) + 1) g sigmoid(alpha g)``, ``g`` the
    # gate clamped below ``limit`` (0: not gpt-oss)
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0

    @property
    def architecture(self) -> str:
        """The Hugging Face architecture name (``architectures[0]``)."""
        return self.family.architecture

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_window(self) -> int | None:
        """The window of every layer, where all of them are sliding (the KV cache may then
        drop what is behind it); None where some layer attends to every position."""
        if self.layer_types and all(t == SLIDING for t in self.layer_types):
            return self.sliding_window
        return None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``; None where it attends to every position."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def __post_init__(self) -> None:
        if self.family.moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(
                f"{self.architecture} needs 0 < num_experts_per_tok "
                f"({self.num_experts_per_tok}) <= num_experts ({self.num_experts})")
        if self.family.moe and self.moe_intermediate_size < 1:
            raise ModelLoadError(f"{self.architecture} needs moe_intermediate_size >= 1")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(
                f"unsupported hidden_act {self.hidden_act!r} "
                f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers or not set(
                    self.layer_types) <= {FULL, SLIDING}:
                raise ModelLoadError(f"layer_types must name {FULL!r} or {SLIDING!r} for each "
                                     f"of the {self.num_hidden_layers} layers")
            if self.sliding_window is None or self.sliding_window < 1:
                raise ModelLoadError("sliding_attention layers need a sliding_window >= 1")
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
    def from_hf_dict(cls, d: Mapping[str, Any],
                     families: Mapping[str, ModelFamily]) -> ModelConfig:
        """Build from a parsed ``config.json`` (transformers 4.x and 5.x rope layouts);
        ``families``: the supported ones by Hugging Face architecture name."""
        archs = d.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json names no architecture ('architectures' is empty)")
        family = families.get(archs[0])
        if family is None:
            raise ModelLoadError(f"unsupported model architecture {archs[0]!r} "
                                 f"(supported: {', '.join(sorted(families))})")
        if d.get("mlp_bias"):
            raise ModelLoadError("unsupported config: mlp_bias = true")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if d.get(key) is not None:
                raise ModelLoadError(f"unsupported config: {key} = {d[key]}")
        if d.get("use_bidirectional_attention"):
            raise ModelLoadError("unsupported config: use_bidirectional_attention = true")
        try:
            num_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            theta, scaling, sliding_theta = _hf_rope_of(d, family)
            num_layers = int(d["num_hidden_layers"])
            window, layer_types = _hf_layer_types(d, family, num_layers)
            bias = bool(d.get("attention_bias", False))
            return cls(
                family=family,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=num_layers,
                num_attention_heads=num_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", family.gemma_norms)),
                attention_bias=family.qkv_bias or bias,
                o_proj_bias=not family.qkv_bias and bias,
                qk_norm=family.qk_norm,
                sliding_window=window,
                layer_types=layer_types,
                hidden_act=d.get("hidden_activation") or d.get("hidden_act", "silu"),
                query_pre_attn_scalar=(float(d.get("query_pre_attn_scalar", 256))
                                       if family.gemma_norms else None),
                sliding_rope_theta=sliding_theta,
                **(_hf_moe_fields(d, num_layers) if family.moe else {}),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks the required key {e.args[0]!r}") from None

    @classmethod
    def from_gguf_metadata(
        cls, meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]],
        families: Mapping[str, ModelFamily],
    ) -> ModelConfig:
        """Build from GGUF key/values and the tensors' shapes (torch order: rows first);
        ``families``: the supported ones by llama.cpp architecture name.

        Tied embeddings are recognised by the absence of ``output.weight``; a ``rope_freqs``
        tensor is not read here (the loader turns it into a ``freq_factors`` rope_scaling).
        """
        arch = meta.get("general.architecture")
        if arch not in families:
            raise ModelLoadError(
                f"unsupported GGUF architecture {arch!r} "
                f"(supported: {', '.join(sorted(families))})"
            )
        family = families[arch]

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
            family=family,
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
            qk_norm=family.qk_norm,
            **_gguf_family_fields(meta, arch, family, int(get("block_count")), hidden,
                                  num_heads),
            **(_gguf_moe_fields(meta, arch, family, tensor_shapes) if family.moe else {}),
        )

    def kv_cache_shape(self, num_blocks: int, block_size: int,
                       int8: bool = False) -> tuple[int, ...]:
        """One layer's paged KV cache: ``[2 (k, v), num_blocks, block_size, kv_heads, D]``,
        or ``D + 4`` bytes a row where ``int8`` (see ``kv_int8``)."""
        return (2, num_blocks, block_size, self.num_key_value_heads,
                row_width(self.head_dim, int8))


def _gguf_family_fields(meta: Mapping[str, Any], arch: str, family: ModelFamily,
                       num_layers: int, hidden: int, num_heads: int) -> dict[str, Any]:
    """The sliding window and Gemma 3's fields of a GGUF file, as llama.cpp reads them.

    ``{arch}.attention.sliding_window`` sets the window, on the layers
    ``attention.sliding_window_pattern`` marks (per-layer flags, or a period; default: 6
    for Gemma 3, every layer for Phi-3, whose window llama.cpp itself ignores and
    transformers does not). Gemma 3's sliding layers take the rotary base
    ``rope.freq_base_swa``, and its q . k scale is llama.cpp's: ``hidden / heads`` for the
    62-layer (27B) model, else the head size (what ``query_pre_attn_scalar`` is for each
    released size)."""
    fields: dict[str, Any] = {}
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern",
                           6 if family.gemma_norms else 0)
        if isinstance(pattern, list):
            types = tuple(SLIDING if flag else FULL for flag in pattern)
        else:  # llama.cpp's: 0 every layer sliding, n the last of every n full
            pattern = int(pattern)
            types = tuple(SLIDING if pattern == 0 or i % pattern < pattern - 1 else FULL
                          for i in range(num_layers))
        if SLIDING in types:
            fields.update(sliding_window=int(window), layer_types=types)
    if family.gemma_norms:
        head_dim = int(meta.get(f"{arch}.attention.key_length", 256))
        fields.update(
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=float(hidden // num_heads if num_layers == 62 else head_dim),
            sliding_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        )
    return fields


def _hf_moe_fields(d: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The experts of a config.json as transformers reads them: ``num_experts`` (Qwen) or
    ``num_local_experts`` (Mixtral); each expert ``moe_intermediate_size`` wide, or
    ``intermediate_size`` (Mixtral); ``norm_topk_prob`` (absent: true, as Mixtral's router
    always renormalises); the dense layers ``mlp_only_layers`` and those off every
    ``decoder_sparse_step``-th."""
    step = int(d.get("decoder_sparse_step") or 1)
    only = {int(i) for i in d.get("mlp_only_layers") or ()}
    return dict(
        num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 0),
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
        swiglu_limit=float(d.get("swiglu_limit") or 0.0),
        swiglu_alpha=float(d.get("swiglu_alpha") or 0.0),
        dense_mlp_layers=tuple(i for i in range(num_layers)
                               if i in only or (i + 1) % step),
    )


def _gguf_moe_fields(meta: Mapping[str, Any], arch: str, family: ModelFamily,
                     tensor_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The experts of a GGUF file as llama.cpp reads them (the renormalisation by
    ``expert_weights_norm`` where the file has it, else the family's); a layer without a
    router (``ffn_gate_inp``) keeps a dense MLP."""
    layers = int(meta[f"{arch}.block_count"])
    return dict(
        dense_mlp_layers=tuple(i for i in range(layers)
                               if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes),
        num_experts=int(meta.get(f"{arch}.expert_count") or 0),
        num_experts_per_tok=int(meta.get(f"{arch}.expert_used_count") or 0),
        moe_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length")
                                  or meta.get(f"{arch}.feed_forward_length") or 0),
        norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm",
                                     family.gguf_norm_topk_prob)),
        shared_expert_intermediate_size=int(
            meta.get(f"{arch}.expert_shared_feed_forward_length") or 0),
    )


def _hf_rope_of(d: Mapping[str, Any], family: ModelFamily
                ) -> tuple[float, dict[str, Any] | None, float | None]:
    """(theta, scaling, sliding layers' theta or None) of ``family``'s config ``d``.

    Gemma 3 gives each layer type its own rotary: transformers 5 nests ``rope_parameters``
    by layer type, 4.x has ``rope_theta`` (+ ``rope_scaling``) for the full layers and
    ``rope_local_base_freq`` for the sliding ones."""
    params = d.get("rope_parameters") or {}
    partial = float((params.get(FULL) or params).get("partial_rotary_factor",
                                                     d.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"unsupported config: partial_rotary_factor = {partial}")
    if not family.gemma_norms:
        return (*_hf_rope(d), None)
    if FULL in params:
        theta, scaling = _hf_rope({"rope_parameters": params[FULL]})
        sliding_theta, sliding_scaling = _hf_rope({"rope_parameters": params[SLIDING]})
    else:
        theta, scaling = _hf_rope({"rope_theta": 1_000_000.0, **d})
        sliding_theta, sliding_scaling = float(d.get("rope_local_base_freq", 10000.0)), None
    if sliding_scaling is not None:
        raise ModelLoadError("unsupported config: rope scaling on the sliding layers")
    return theta, scaling, sliding_theta


def _hf_layer_types(d: Mapping[str, Any], family: ModelFamily,
                    num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers reads them: ``layer_types`` where the
    config lists them; else every layer (Mistral, Phi-3), Gemma 3's pattern (every
    ``sliding_window_pattern``-th layer full), or Qwen's (layers from ``max_window_layers``
    on) where ``use_sliding_window``. A window of None, or switched off by
    ``use_sliding_window``, makes every layer full."""
    window = d.get("sliding_window")
    if window is None or not d.get("use_sliding_window", True):
        return None, ()
    window = int(window)
    if d.get("layer_types"):
        types = tuple(d["layer_types"])
    elif family.window_on_every_layer:
        types = (SLIDING,) * num_layers
    elif family.gemma_norms:
        pattern = int(d.get("sliding_window_pattern", 6))
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    else:
        first = int(d.get("max_window_layers", num_layers))
        types = tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    return (window, types) if SLIDING in types else (None, ())


def _hf_rope(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` pair."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)  # _hf_rope_of checks it is 1
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}
