"""A Mistral whose every layer has a sliding window, through the whole engine: the
greedy tokens equal transformers' under each schedule while the KV blocks behind the
window return to the pool (``KVCacheManager.release_behind_window``)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_model import make_tiny_model_dir
from tokenmill import LLM, SamplingParams

WINDOW = 8
NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
SCHEDULES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    # 16 blocks of 4: the 6 requests' 400-odd tokens fit at once only as windows
    "small_pool": {"num_kv_blocks": 16, "max_model_len": 64},
    # verify steps: several tokens of a sequence with context, over the window
    "speculative": {"speculative_ngram": 4, "ngram_min": 1, "ngram_max": 3,
                    "speculative_disable_by_batch_size": 64},
}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp("mistral"), "mistral",
                               sliding_window=WINDOW)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_windowed_model_equals_transformers(mistral, schedule) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(3, 50))] for _ in range(6)]
    prompts[4] = prompts[2][:16] + prompts[4]  # a prefix-cache hit
    if "max_model_len" in SCHEDULES[schedule]:
        prompts = [p[:40] for p in prompts]
    llm = LLM(mistral, dtype="float32", block_size=4, **SCHEDULES[schedule])
    assert llm.client.core.kv.window == WINDOW
    outputs = llm.generate(prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), max_new_tokens=NUM_TOKENS, do_sample=False,
                          eos_token_id=None)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == ref
    llm.client.core.check_integrity()
