"""A Qwen3-MoE and a gpt-oss through the whole engine in float32: the greedy tokens equal
transformers' when requests share steps (their tokens routed to experts together), when
prompts are split by chunked prefill, when a prompt's prefix comes from the cache, and
when a request is preempted and recomputed (gpt-oss: its sinks and alternating windows
under the last schedule, which does all of these)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_model import make_tiny_model_dir
from tokenmill import LLM, SamplingParams

NUM_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
SCHEDULES = {
    "batched": {},
    "chunked_prefill": {"max_num_batched_tokens": 7},
    # 20 blocks of 4 for 6 requests of up to 70 tokens: some are preempted
    "preempted": {"num_kv_blocks": 20, "max_model_len": 72, "max_num_batched_tokens": 16},
}


MODELS = {
    "qwen3_moe": {"norm_topk_prob": True},
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                "head_dim": 16, "sliding_window": 8, "num_hidden_layers": 4},
}


@pytest.fixture(scope="module", params=MODELS)
def model(request, tmp_path_factory) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param,
                               **MODELS[request.param])


@pytest.fixture(scope="module")
def prompts_and_references(model) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(3, 50))] for _ in range(6)]
    prompts[4] = prompts[2][:16] + prompts[4]  # a prefix-cache hit
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    references = [
        hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=NUM_TOKENS, do_sample=False,
                    eos_token_id=None)[0, len(p):].tolist()
        for p in prompts]
    return prompts, references


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_moe_model_equals_transformers(model, prompts_and_references, schedule) -> None:
    if "gpt_oss" in model and schedule != "preempted":
        pytest.skip("gpt-oss runs the schedule that does everything")
    prompts, references = prompts_and_references
    llm = LLM(model, dtype="float32", block_size=4, **SCHEDULES[schedule])
    first = llm.generate([prompts[2]], GREEDY)  # cached for prompt 4's prefix
    outputs = llm.generate(prompts, GREEDY)
    assert first[0].outputs[0].token_ids == references[2]
    for output, reference in zip(outputs, references, strict=True):
        assert output.outputs[0].token_ids == reference
    assert outputs[4].num_cached_tokens >= 16
    if schedule == "preempted":
        assert sum(o.outputs[0].stats.num_preemptions for o in outputs) > 0
    llm.client.core.check_integrity()
