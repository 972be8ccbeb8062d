"""Read a GGUF file: its ModelConfig and its tensors under Hugging Face names
(llama.cpp's tensor kinds, with each family's own: ``ModelFamily.gguf_layer_names``).

Tensors of every type in ``blocks.SUPPORTED_TYPES`` load: dequantized to float32
(``gguf.quants.dequantize``, bit for bit), or, with ``keep_blocks``, each matrix as the
file's own rows (``blocks.FileRows``) for a weight format that computes on them
(``--quantization gguf``). For the llama architecture (Llama, Mistral), llama.cpp's
converter interleaves the rows of each head of Q and K (for its "pairs of adjacent dims"
rotary layout); ``_unpermute_heads`` restores Hugging Face's "rotate half" order::

    HF rows of a head:    [ x0 x1 ... x_{D/2-1} | y0 y1 ... y_{D/2-1} ]
    GGUF rows of a head:  [ x0 y0 x1 y1 ... x_{D/2-1} y_{D/2-1} ]

A mixture of experts stores each layer's experts' projections as one 3-D tensor
(``ffn_{gate,up,down}_exps``, ``[experts, rows, cols]``): it is read as one matrix per
expert under transformers' per-expert names (``mlp.experts.E.gate_proj``), each as the
file's own rows (``FileRows``) where ``keep_blocks``; its expert count and shapes are
checked against the config before ``open_gguf`` returns.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from tokenmill.errors import ModelLoadError
from tokenmill.models.config import ModelConfig
from tokenmill.models.gguf.blocks import DENSE_TYPES, SUPPORTED_TYPES, FileRows
from tokenmill.models.layers.experts import check_expert_weight
from tokenmill.models.registry import GGUF_FAMILIES

GGUF_MAGIC = b"GGUF"

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# 3-D expert tensors -> the projection of each expert (``mlp.experts.E.<projection>``)
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
ROPE_FREQS = "rope_freqs.weight"


def open_gguf(path: str, keep_blocks: bool = False
              ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | FileRows]]]:
    """(config, lazily read weights) of the GGUF file at ``path``: float32 tensors, or with
    ``keep_blocks`` each matrix (2-D tensor) as its ``FileRows``.

    Every check that can fail on the file as a whole (magic, parse, tensor types,
    metadata) runs before this returns, so a caller builds no model for a file it cannot
    load; a tensor whose data cannot be decoded raises ``ModelLoadError`` as it is read.
    """
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")
    try:
        reader = GGUFReader(path, "r")
        metadata = _metadata(reader)
    except (ValueError, IndexError, OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(
            f"corrupt GGUF file {path} (truncated or damaged, {os.path.getsize(path)} "
            f"bytes): {e}") from None
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            names = ", ".join(q.name for q in SUPPORTED_TYPES)
            raise ModelLoadError(
                f"tensor {t.name!r} in {path} uses unsupported GGUF type "
                f"{t.tensor_type.name} (supported: {names})"
            )
    shapes = {t.name: _torch_shape(t) for t in reader.tensors}
    config = ModelConfig.from_gguf_metadata(metadata, shapes, GGUF_FAMILIES)
    tensors = {t.name: t for t in reader.tensors}
    if ROPE_FREQS in tensors:
        factors = tuple(float(x) for x in _dequantized(tensors.pop(ROPE_FREQS)))
        config = dataclasses.replace(
            config, rope_scaling={"rope_type": "freq_factors", "factors": factors}
        )
    _check_experts(shapes, config)
    layer_names = {**_LAYER_NAMES, **dict(config.family.gguf_layer_names)}
    entries = [(*_hf_name(t.name, layer_names), t) for t in tensors.values()]
    return config, _weights(path, entries, config, keep_blocks)


def holds_quantized_matrices(path: str) -> bool:
    """Whether ``path`` is a GGUF file storing some matrix in a quantized type (not F32,
    F16 or BF16); False for anything else, a folder or a file it cannot read included
    (loading it says why)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                return False
        tensors = GGUFReader(path, "r").tensors
    except (ValueError, IndexError, OSError, UnicodeDecodeError):
        return False
    return any(len(t.shape) >= 2 and t.tensor_type not in DENSE_TYPES for t in tensors)


def _check_experts(shapes: dict[str, tuple[int, ...]], config: ModelConfig) -> None:
    """Raises ``ModelLoadError`` naming what disagrees where a 3-D expert tensor or a router
    does not fit the config's experts (``layers.experts.check_expert_weight``)."""
    for name, shape in shapes.items():
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk":
            continue
        if parts[2] in _EXPERT_NAMES:
            if len(shape) != 3 or shape[0] != config.num_experts:
                raise ModelLoadError(
                    f"GGUF tensor {name!r} has shape {shape}: not {config.num_experts} "
                    f"experts, the file's expert_count")
            check_expert_weight(config, _expert_name(parts[1], parts[2], 0), shape[1:])
        elif parts[2] == "ffn_gate_inp":
            check_expert_weight(config, f"model.layers.{parts[1]}.mlp.gate.weight", shape)


def _expert_name(layer: str, kind: str, expert: int) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_NAMES[kind]}.weight"


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalar and string key/values (the large tokenizer arrays are not decoded)."""
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("tokenizer.")
    }


def _torch_shape(t: ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first; torch lists them outermost first."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def _file_rows(path: str, t: ReaderTensor) -> FileRows:
    rows, cols = _torch_shape(t)
    return FileRows(t.tensor_type, _read_bytes(path, t).reshape(rows, -1), cols)


def _read_bytes(path: str, t: ReaderTensor) -> np.ndarray:
    """``t``'s bytes, read into this process's memory: not a view of the reader's mapping
    of the file, whose pages, once read, would stay resident as long as the mapping does
    (the whole file, while a weight format keeps a few tensors' rows)."""
    data = np.fromfile(path, dtype=np.uint8, count=t.n_bytes, offset=t.data_offset)
    if data.size != t.n_bytes:
        raise ValueError(f"{t.n_bytes} bytes expected, the file ends after {data.size}")
    return data


def _dequantized(t: ReaderTensor) -> torch.Tensor:
    array = dequantize(t.data, t.tensor_type)
    if not array.flags.writeable:  # a memory-mapped F32 tensor: copy out of the file
        array = np.array(array)
    return torch.from_numpy(array).reshape(_torch_shape(t))


def _weights(
    path: str, entries: list[tuple[str, str, ReaderTensor]], config: ModelConfig,
    keep_blocks: bool,
) -> Iterator[tuple[str, torch.Tensor | FileRows]]:
    """Yields (HF name, float32 tensor as Hugging Face stores it, or ``FileRows``);
    ``entries`` are (HF name, GGUF kind, tensor). Gemma 3's converter stores its norms as
    ``1 + weight``: the 1 is taken back off."""
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    permute, gemma = config.family.gguf_permutes_qk, config.family.gemma_norms
    for name, kind, t in entries:
        if kind in _EXPERT_NAMES:
            yield from _experts(path, name.split(".")[2], kind, t, keep_blocks)
            continue
        try:
            if keep_blocks and len(t.shape) == 2:
                weight = _file_rows(path, t)
                if permute and kind in heads:
                    rows = torch.arange(weight.shape[0])
                    weight = weight.take(_unpermute_heads(rows, heads[kind]))
            else:
                weight = _dequantized(t)
                if permute and kind in heads:
                    weight = _unpermute_heads(weight, heads[kind])
                elif gemma and name.endswith("norm.weight"):
                    weight = weight - 1.0
                elif kind == "ffn_gate_inp_shexp":  # llama.cpp's [H]; transformers' [1, H]
                    weight = weight.reshape(1, -1)
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"corrupt tensor {t.name!r} in {path}: {e}") from None
        yield name, weight


def _experts(path: str, layer: str, kind: str, t: ReaderTensor,
             keep_blocks: bool) -> Iterator[tuple[str, torch.Tensor | FileRows]]:
    """Each expert's matrix of the 3-D tensor ``t``: its ``FileRows`` where ``keep_blocks``,
    else float32."""
    experts, rows, cols = _torch_shape(t)
    try:
        data = (_read_bytes(path, t) if keep_blocks else t.data.view(np.uint8)).reshape(
            experts * rows, -1)
    except ValueError as e:
        raise ModelLoadError(f"corrupt tensor {t.name!r} in {path}: {e}") from None
    for expert in range(experts):
        weight = FileRows(t.tensor_type, data[expert * rows:(expert + 1) * rows], cols)
        if not keep_blocks:
            try:
                weight = weight.dequantize()
            except (ValueError, RuntimeError) as e:
                raise ModelLoadError(f"corrupt tensor {t.name!r} in {path}: {e}") from None
        yield _expert_name(layer, kind, expert), weight


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> tuple[str, str]:
    """``blk.3.attn_k.weight`` -> (``model.layers.3.self_attn.k_proj.weight``, ``attn_k``),
    by ``layer_names`` (``_LAYER_NAMES`` with the family's own)."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}", parts[0]
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES:
        return f"model.layers.{parts[1]}.mlp.experts.{_EXPERT_NAMES[parts[2]]}", parts[2]
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}", parts[2]
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute_heads(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of Q/K (weights ``[rows, in]`` or biases)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
