"""Speculative decoding through the whole engine on a tiny float32 model: outputs are
the same token for token as without it (greedy, penalties, min_tokens, stop tokens
and strings, seeded sampling; batched, chunked, preempted), and verification samples
the model's distribution."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.core.types import ScheduledRequest, SchedulerOutput
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.models.loader import load_model

SPEC = {"speculative_ngram": 4, "ngram_min": 1, "ngram_max": 3,
        "speculative_disable_by_batch_size": 64}  # drafts in every batch


def repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Half with a repeated phrase (lookups find drafts), half random."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 2:
            out.append([rng.randrange(3, 400) for _ in range(rng.randrange(4, 40))])
        else:
            phrase = [rng.randrange(3, 400) for _ in range(rng.randrange(3, 9))]
            out.append((phrase * 8)[:rng.randrange(8, 40)])
    return out


def run(model: str, prompts, params, **options):
    llm = LLM(model, dtype="float32", **options)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    llm.client.core.check_integrity()
    return outputs


SCHEDULES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 64},
    "no_prefix_cache": {"enable_prefix_caching": False, "max_num_seqs": 5},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_greedy_output_is_identical_with_speculation(tiny_model, schedule) -> None:
    options = SCHEDULES[schedule]
    batch = repetitive_prompts(24)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run(tiny_model, batch, params, **options)
    spec = run(tiny_model, batch, params, **options, **SPEC)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    drafted = sum(o.stats.num_draft_tokens for o in spec)
    accepted = sum(o.stats.num_accepted_tokens for o in spec)
    assert 0 < accepted < drafted
    if schedule == "preemption":
        assert sum(o.stats.num_preemptions for o in spec) > 0


def test_penalties_min_tokens_stop_ids_and_logprobs_are_identical(tiny_model) -> None:
    batch = repetitive_prompts(12, seed=3)
    plain_first = run(tiny_model, batch, SamplingParams(temperature=0.0, max_tokens=20))
    stop_ids = sorted({o.token_ids[12] for o in plain_first})[:4]
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, logprobs=2,
                            repetition_penalty=1.05, frequency_penalty=0.1,
                            stop_token_ids=stop_ids)
    plain = run(tiny_model, batch, params)
    spec = run(tiny_model, batch, params, **SPEC)
    assert sum(o.stats.num_accepted_tokens for o in spec) > 0
    assert any(o.stop_reason in stop_ids for o in spec)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason)
        assert len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert (y.token_id, y.rank) == (x.token_id, x.rank)
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


def test_stop_strings_cut_at_the_same_token(tiny_model) -> None:
    batch = repetitive_prompts(8, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = run(tiny_model, batch, params)
    llm = LLM(tiny_model, dtype="float32", **SPEC)
    for prompt, ref in zip(batch, reference, strict=True):
        stop = ref.text[len(ref.text) // 2:][:3]
        if not stop.strip():
            continue
        stopped = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
        plain = run(tiny_model, [prompt], stopped)[0]
        spec = llm.generate([prompt], stopped)[0].outputs[0]
        assert (spec.text, spec.token_ids, spec.finish_reason, spec.stop_reason) == (
            plain.text, plain.token_ids, plain.finish_reason, plain.stop_reason)
    llm.client.core.check_integrity()


def test_seeded_sampling_is_identical_with_speculation(tiny_model) -> None:
    batch = repetitive_prompts(12, seed=7)
    params = [SamplingParams(temperature=0.7, top_k=40, top_p=0.95, repetition_penalty=1.02,
                             seed=i, max_tokens=24, ignore_eos=True) for i in range(12)]
    plain = run(tiny_model, batch, params)
    spec = run(tiny_model, batch, params, **SPEC)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.stats.num_accepted_tokens for o in spec) > 0


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _assert_follows(samples: list[int], probs: torch.Tensor) -> None:
    """Chi-square goodness of fit; tokens expected fewer than 5 times share one bin."""
    n = len(samples)
    counts = Counter(samples)
    big = [t for t in range(probs.numel()) if probs[t] * n >= 5]
    observed = [counts[t] for t in big] + [n - sum(counts[t] for t in big)]
    expected = [float(probs[t]) * n for t in big] + [n - sum(float(probs[t]) * n for t in big)]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    assert len(big) >= 3, "too few bins to test"
    assert stat < _chi_square_critical(len(big)), (stat, len(big))


def test_verification_follows_the_target_distribution(tiny_model) -> None:
    """Many copies of one request with 2 drafts, verified at temperature 0.2 in one step:
    the first token follows p(. | prompt); after an accepted first draft, the second
    token follows p(. | prompt, d1), as transformers computes them."""
    temperature, copies = 0.2, 2000
    prompt = [17, 45, 210, 45, 17, 99, 45, 210]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        p0 = torch.softmax(reference(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        d1 = int(p0.argmax())
        p1 = torch.softmax(reference(torch.tensor([prompt + [d1]])).logits[0, -1]
                           / temperature, -1)
        d2 = int(p1.argsort(descending=True)[1])
    model, _ = load_model(tiny_model, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, num_kv_blocks=2,
                         block_size=16, seed=0)
    params = SamplingParams(temperature=temperature, max_tokens=8)
    items = tuple(ScheduledRequest(
        req_id=str(i), token_ids=(*prompt, d1, d2), start_pos=0, block_ids=(0,), sample=True,
        sampling_params=params, prompt_token_ids=prompt, output_token_ids=[],
        draft_token_ids=(d1, d2)) for i in range(copies))
    sampled = runner.execute(SchedulerOutput(items, frozenset())).sampled
    first = [tokens[0] for tokens in sampled.values()]
    second = [tokens[1] for tokens in sampled.values() if tokens[0] == d1]
    assert all(len(t) == 1 + (t[0] == d1) + (t[0] == d1 and t[1] == d2)
               for t in sampled.values())
    _assert_follows(first, p0)
    assert len(second) > 300
    _assert_follows(second, p1)
