"""Write a tiny Hugging Face model folder as a GGUF file, the way llama.cpp's converter does.

Independent of the loader under test: its own name tables, and llama.cpp's own Q/K row
permutation (``llama_cpp_permute``, copied from ``convert_hf_to_gguf.py``). Matrices are
stored in the requested type, vectors (norms, biases) in F32, like llama.cpp. For
``arch="gemma3"``, norms are stored as ``1 + weight`` and the sliding window, its layer
pattern and its rotary base go in the metadata, as the converter writes them (the pattern
too, which the converter leaves to llama.cpp's default); ``arch="phi3"`` keeps its fused
projections under ``attn_qkv`` and ``ffn_up``. For the
types the gguf package cannot quantize (the K-quants), or on request, matrices are
``random_blocks`` of the type instead of the model's weights. For ``arch="qwen3moe"`` or
``"qwen2moe"`` each layer's experts are stacked into 3-D ``ffn_*_exps`` tensors (quantized
as its matrices) and the expert counts and widths go in the metadata; the shared expert's
gate is written as a vector, as llama.cpp's model holds it.
"""

from __future__ import annotations

import json
import math
import os

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
ARCH_LAYER_NAMES = {
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "gemma3": {"pre_feedforward_layernorm": "ffn_norm",
               "post_attention_layernorm": "post_attention_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
}
GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


# The types gguf.quants can quantize (the others are written as random blocks).
QUANTIZERS = {
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4,
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of ``llama_cpp_permute``."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# Byte offsets of the float16 scale fields (d, and dmin or m) in one block of each type,
# as gguf.quants reads them.
F16_FIELDS = {
    GGMLQuantizationType.Q4_0: (0,), GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,), GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q8_0: (0,), GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,), GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,),
}
DENSE = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator, scale: float = 1e-3) -> np.ndarray:
    """``[rows, cols]`` of ``qtype`` as the file stores it: random bytes (every quant,
    sub-scale and sign bit pattern) with the float16 scale fields set to finite values of
    magnitude up to ``scale``; dense types: random values of that magnitude."""
    if qtype in DENSE:
        return (rng.standard_normal((rows, cols)) * scale).astype(DENSE[qtype])
    if qtype == GGMLQuantizationType.BF16:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * scale, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        values = rng.uniform(-scale, scale, (data.shape[0], 1)).astype(np.float16)
        data[:, offset:offset + 2] = values.view(np.uint8)
    return data.reshape(rows, -1)


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    module, suffix = hf_name.rsplit(".", 1)
    if module in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    names = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}
    return f"blk.{layer}.{names[rest]}.{suffix}"


def llama3_rope_factors(cfg: dict, head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp writes for a llama3-scaled model."""
    rope = cfg["rope_parameters"]
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each layer's ``mlp.experts.E.<projection>.weight`` stacked in
    expert order into one ``mlp.experts.<projection>.weight`` ``[experts, rows, cols]``."""
    out, experts = {}, {}
    for name, tensor in state.items():
        parts = name.split(".")
        if parts[3:5] == ["mlp", "experts"]:
            stacked = ".".join([*parts[:5], *parts[6:]])
            experts.setdefault(stacked, {})[int(parts[5])] = tensor
        else:
            out[name] = tensor
    for name, by_index in experts.items():
        out[name] = torch.stack([by_index[i] for i in range(len(by_index))])
    return out


def write_gguf(
    hf_dir: str, out_path: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    arch: str = "llama", overrides: dict[str, GGMLQuantizationType] | None = None,
    random: bool = False, seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Convert ``hf_dir`` into ``out_path``; returns the HF state dict *as stored* (each
    matrix quantized and dequantized back), to load into a reference model. Matrices of
    K-quant types, or all with ``random``, are ``random_blocks`` (seeded by ``seed``)."""
    rng = np.random.default_rng(seed)
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope = cfg["rope_parameters"]
    if arch == "gemma3":
        rope = rope["full_attention"]
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch in ("phi3", "gemma3") and cfg.get("sliding_window"):  # not for llama: Mistral's
        writer.add_sliding_window(cfg["sliding_window"])          # window is dropped
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern",
                          cfg.get("sliding_window_pattern", 6))
        writer.add_float32(f"{arch}.rope.freq_base_swa",
                           cfg["rope_parameters"]["sliding_attention"]["rope_theta"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if arch.endswith("moe"):
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg, head_dim))
    stored = {}
    for name, tensor in stacked_experts(
            load_file(os.path.join(hf_dir, "model.safetensors"))).items():
        data = tensor.float().numpy()
        if data.ndim == 3:  # experts: quantized as the matrices, stored per expert
            kind = (overrides or {}).get(gguf_name(name, arch), qtype)
            packed = quantize(data.reshape(-1, data.shape[2]), kind)
            values = dequantize(packed, kind).reshape(data.shape)
            for expert, matrix in enumerate(values):
                parts = name.split(".")
                per_expert = ".".join([*parts[:5], str(expert), *parts[5:]])
                stored[per_expert] = torch.from_numpy(np.array(matrix, dtype=np.float32))
            writer.add_tensor(gguf_name(name, arch), packed.reshape(*data.shape[:2], -1),
                              raw_dtype=kind)
            continue
        if name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)
        target = gguf_name(name, arch)
        kind = (overrides or {}).get(target, qtype if data.ndim == 2 else GGMLQuantizationType.F32)
        if data.ndim == 2 and (random or kind not in QUANTIZERS):
            packed = random_blocks(kind, *data.shape, rng)
            file_layout = dequantize(packed, kind).reshape(data.shape)
            if arch == "llama" and ".q_proj." in name:
                file_layout = llama_cpp_unpermute(file_layout, n_head)
            elif arch == "llama" and ".k_proj." in name:
                file_layout = llama_cpp_unpermute(file_layout, n_kv)
            stored[name] = torch.from_numpy(np.array(file_layout, dtype=np.float32))
            writer.add_tensor(target, packed, raw_dtype=kind)
            continue
        packed = quantize(data, kind)
        stored[name] = torch.from_numpy(dequantize(packed, kind).reshape(data.shape).copy())
        if arch == "llama" and ".q_proj." in name:
            packed = quantize(llama_cpp_permute(data, n_head), kind)
        elif arch == "llama" and ".k_proj." in name:
            packed = quantize(llama_cpp_permute(data, n_kv), kind)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            packed = quantize(data + 1, kind)
        writer.add_tensor(target, packed, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored
