"""The tiny models, run through the paged path in float32, agree with Hugging Face."""

from __future__ import annotations

import pytest
import torch
from paged_runner import PagedRunner, greedy_generate
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tiny_model import LLAMA3_ROPE
from tokenmill.models.config import _hf_rope
from tokenmill.models.layers.rotary import rope_attention_factor, rope_inv_freq
from tokenmill.models.loader import load_model

CPU = torch.device("cpu")
VARIANTS = ["llama", "llama_untied", "llama3_rope", "yarn_rope", "qwen2"]
PROMPT = [5, 17, 300, 42, 8, 99, 123, 7, 256, 31, 64, 200, 11, 3, 77, 150, 9, 410, 21, 60]


def load_both(model_dir: str):
    ours, _ = load_model(model_dir, torch.float32, CPU)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return ours, theirs


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("variant", [*VARIANTS, "linear_rope"])
def test_prefill_logits_match_hf(tiny_model_dir, variant):
    ours, theirs = load_both(tiny_model_dir(variant))
    got = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    torch.testing.assert_close(got, hf_logits(theirs, PROMPT), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_decode_matches_hf(tiny_model_dir, variant):
    ours, theirs = load_both(tiny_model_dir(variant))
    ref = theirs.generate(
        torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        max_new_tokens=24, do_sample=False, eos_token_id=None,
    )[0, len(PROMPT):].tolist()
    assert greedy_generate(ours, PROMPT, 24, chunk_size=6) == ref

    # decode-step logits, position by position, against one full HF forward
    runner = PagedRunner(ours, block_size=16)
    steps = [runner.step([(0, PROMPT)])[0]]
    steps += [runner.step([(0, [tok])])[0] for tok in ref[:-1]]
    full = hf_logits(theirs, PROMPT + ref[:-1])
    torch.testing.assert_close(torch.stack(steps), full[len(PROMPT) - 1 :], atol=1e-4, rtol=1e-4)


def test_llama3_variant_exercises_scaling():
    """The llama3 tiny model's frequencies really differ from plain RoPE (low, mid, high)."""
    plain = rope_inv_freq(16, 10000.0, None)
    scaled = rope_inv_freq(16, 10000.0, LLAMA3_ROPE)
    assert scaled[0] == plain[0]  # short wavelength: kept
    assert torch.isclose(scaled[-1], plain[-1] / 8)  # long wavelength: divided by factor
    assert ((scaled != plain) & ~torch.isclose(scaled, plain / 8)).any()  # smoothed band


@pytest.mark.parametrize("extra", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},  # gpt-oss's
    {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen's long context
    {"factor": 8.0, "original_max_position_embeddings": 2048, "mscale": 1.0,
     "mscale_all_dim": 0.5},
])
def test_yarn_frequencies_and_factor_equal_transformers(extra):
    """YaRN's frequencies bit for bit, and its factor on cos and sin, as transformers'."""
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64,
                         max_position_embeddings=131072,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **extra})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    theta, scaling = _hf_rope(config.to_dict())
    assert torch.equal(rope_inv_freq(64, theta, scaling), inv_freq)
    assert rope_attention_factor(scaling) == factor > 1
