"""A tiny random-weight Llama folder and its Hugging Face reference, once per session."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_model import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-engine"))


@pytest.fixture(scope="session")
def hf_greedy(tiny_model):
    """``hf_greedy(prompt_ids, n)`` -> the n tokens transformers' greedy search picks."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    return generate
