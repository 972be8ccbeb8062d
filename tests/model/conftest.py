"""Fixtures for the model tests: tiny random-weight model folders, built once per session."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# tests/ holds tiny_model.py, shared with other test folders.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiny_model import LLAMA3_ROPE, make_tiny_model_dir  # noqa: E402

YARN_ROPE = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 64, "truncate": False}

TINY_VARIANTS = {
    "llama": ("llama", {}),
    "llama_untied": ("llama", {"tie_word_embeddings": False}),
    "llama3_rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    # YaRN as gpt-oss sets it (no truncation), over a small original context
    "yarn_rope": ("llama", {"rope_scaling": YARN_ROPE}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": 8}),
    "phi3": ("phi3", {"sliding_window": 12}),
    # sliding (window 8) and full layers alternating, each with its own rotary base
    "gemma3": ("gemma3", {"num_hidden_layers": 4, "head_dim": 32, "sliding_window": 8,
                          "sliding_window_pattern": 2}),
    "gemma3_head256": ("gemma3", {"head_dim": 256, "sliding_window": 8,
                                  "sliding_window_pattern": 2}),
    # what a llama.cpp-converted file can say: Mistral without a window (the converter
    # drops it), Gemma 3 with the default layer pattern and a head-size scale
    "mistral_no_window": ("mistral", {"sliding_window": None}),
    "gemma3_pattern6": ("gemma3", {"num_hidden_layers": 6, "head_dim": 32,
                                   "query_pre_attn_scalar": 32, "sliding_window": 8}),
    # experts renormalised (as llama.cpp's qwen3moe); a shared expert and a dense layer
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen2_moe": ("qwen2_moe", {"shared_expert_intermediate_size": 48, "mlp_only_layers": [1]}),
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2,
                            "intermediate_size": 32, "sliding_window": 12}),
    # sliding (window 8) and full layers alternating, YaRN, sinks, experts with biases
    "gpt_oss": ("gpt_oss", {"num_local_experts": 8, "num_experts_per_tok": 2,
                            "intermediate_size": 32, "head_dim": 16, "sliding_window": 8,
                            "num_hidden_layers": 4, "rope_scaling": YARN_ROPE}),
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(variant)`` -> folder of that variant of ``TINY_VARIANTS`` (cached)."""
    built: dict[str, str] = {}

    def get(variant: str) -> str:
        if variant not in built:
            arch, overrides = TINY_VARIANTS[variant]
            built[variant] = make_tiny_model_dir(
                tmp_path_factory.mktemp(variant), arch, **overrides
            )
        return built[variant]

    return get


@pytest.fixture(scope="session")
def native():
    """This CPU's ``NativeKernels``; a failed build fails the test where a C++ compiler
    exists."""
    from tokenmill.kernels import native_kernels

    kernels = native_kernels()
    if kernels is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("the native kernels did not build, with a C++ compiler present "
                        "(the log says why)")
        pytest.skip("no C++ compiler here: the native kernels cannot be built")
    return kernels
