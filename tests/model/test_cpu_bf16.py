"""bfloat16 on CPU: the oneDNN-prepacked projections compute what plain ``F.linear`` does."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from paged_runner import PagedRunner
from safetensors.torch import load_file

from tokenmill.models.config import ModelConfig
from tokenmill.models.layers import Linear, can_prepack
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import load_model

CPU = torch.device("cpu")
BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not can_prepack(BF16, CPU), reason="oneDNN not available")


def unpacked_model(model_dir: str, dtype: torch.dtype) -> LlamaForCausalLM:
    with open(os.path.join(model_dir, "config.json")) as f:
        model = LlamaForCausalLM(ModelConfig.from_hf_dict(json.load(f)), dtype, CPU)
    for file in glob.glob(os.path.join(model_dir, "*.safetensors")):
        model.load_weights(load_file(file).items())
    return model


def mixed_batch_logits(model) -> torch.Tensor:
    runner = PagedRunner(model, block_size=4)
    runner.step([(0, list(range(30, 60))), (1, list(range(100, 105)))])
    return runner.step([(0, [7]), (1, list(range(200, 220))), (2, [9, 10, 11])])


@pytest.mark.parametrize("variant", ["llama", "llama_untied", "qwen2"])
def test_prepacked_bf16_matches_plain_bf16(tiny_model_dir, variant):
    model_dir = tiny_model_dir(variant)
    packed, _ = load_model(model_dir, BF16, CPU)
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    assert (packed.packed_tied_head is not None) == (packed.lm_head is None)

    got = mixed_batch_logits(packed)
    plain = mixed_batch_logits(unpacked_model(model_dir, BF16))
    reference = mixed_batch_logits(unpacked_model(model_dir, torch.float32))
    torch.testing.assert_close(got, plain, atol=0.02, rtol=0.02)
    torch.testing.assert_close(got, reference, atol=0.1, rtol=0.05)
