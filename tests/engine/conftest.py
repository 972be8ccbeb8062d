"""A tiny random-weight Llama folder and its Hugging Face reference, once per session."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_model import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-engine"))


@pytest.fixture(scope="session")
def hf_greedy(tiny_model):
    """``hf_greedy(prompt_ids, n)`` -> the n tokens of transformers' greedy argmax."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    @functools.cache
    def cached(prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        # NOTE: a plain argmax loop; generate()'s min_new_tokens would ban EOS, which
        # ignore_eos does not.
        ids, past, out = torch.tensor([prompt_ids]), None, []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                result = model(ids if past is None else ids[:, -1:], past_key_values=past,
                               use_cache=True)
                past = result.past_key_values
                out.append(int(result.logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
        return out

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        return cached(tuple(prompt_ids), max_new_tokens)

    return generate
