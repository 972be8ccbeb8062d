"""logit_bias through the whole engine on a tiny float32 model: a strong bias forces a
token under greedy, -100 bans one (with a structured output and with speculation too),
and the rows of a batch without a bias are what they are in a batch without any."""

from __future__ import annotations

import random
import re

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutput

PATTERN = r"[a-e]{1,20}\."
VOCAB = 400  # the tokenizer's ids, which logit_bias may name (the model's rows are 512)
SPEC = {"speculative_ngram": 4, "ngram_min": 1, "ngram_max": 3,
        "speculative_disable_by_batch_size": 64}


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Half with a repeated phrase (prompt lookup finds drafts), half random."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        phrase = [rng.randrange(3, 390) for _ in range(rng.randrange(3, 9))]
        out.append((phrase * 6)[:rng.randrange(10, 30)] if i % 2 == 0
                   else [rng.randrange(3, 390) for _ in range(rng.randrange(4, 30))])
    return out


def generate(llm: LLM, batch, params):
    outputs = [o.outputs[0] for o in llm.generate(batch, params)]
    llm.client.core.check_integrity()
    return outputs


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model, dtype="float32")


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_a_strong_bias_forces_a_token(llm) -> None:
    batch = prompts(4)
    plain = generate(llm, batch, greedy())
    forced = next(t for t in range(5, 390) if all(t not in o.token_ids for o in plain))
    biased = generate(llm, batch, greedy(logit_bias={forced: 100.0}))
    assert all(o.token_ids == [forced] * 12 for o in biased)


def test_minus_100_bans_a_token(llm) -> None:
    batch = prompts(6, seed=1)
    plain = generate(llm, batch, greedy())
    banned = {t for o in plain for t in (o.token_ids[0], o.token_ids[3]) if t < VOCAB}
    out = generate(llm, batch, greedy(logit_bias={t: -100.0 for t in banned}))
    assert all(not banned & set(o.token_ids) for o in out)
    assert [o.token_ids for o in out] != [o.token_ids for o in plain]


def test_rows_without_a_bias_are_unchanged_bit_for_bit(llm) -> None:
    batch = prompts(8, seed=2)
    plain_params = [greedy(logprobs=3) if i % 2 else
                    SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True,
                                   logprobs=3) for i in range(8)]
    plain = generate(llm, batch, plain_params)
    mixed_params = list(plain_params)
    for i in (0, 3, 6):
        mixed_params[i] = greedy(logit_bias={7: 50.0, 9: -100.0})
    mixed = generate(llm, batch, mixed_params)
    for i in range(8):
        if i in (0, 3, 6):
            assert mixed[i].token_ids != plain[i].token_ids
            continue
        assert mixed[i].token_ids == plain[i].token_ids
        assert mixed[i].logprobs == plain[i].logprobs  # the same floats


def test_a_ban_holds_with_a_structured_output(llm) -> None:
    constraint = StructuredOutput("regex", PATTERN)
    batch = prompts(4, seed=3)
    plain = generate(llm, batch, greedy(24, structured_output=constraint))
    banned = {o.token_ids[0] for o in plain}  # text tokens: within the tokenizer's ids
    out = generate(llm, batch, greedy(24, structured_output=constraint,
                                      logit_bias={t: -100.0 for t in banned}))
    for o in out:
        assert not banned & set(o.token_ids)
        assert o.finish_reason == "stop" and re.fullmatch(PATTERN, o.text), o.text


def test_a_ban_holds_with_speculation(tiny_model) -> None:
    batch = prompts(12, seed=4)
    spec = LLM(tiny_model, dtype="float32", **SPEC)
    plain = generate(spec, batch, greedy(20))
    banned = {o.token_ids[5] for o in plain if o.token_ids[5] < VOCAB}
    params = greedy(20, logit_bias={t: -100.0 for t in banned})
    out = generate(spec, batch, params)
    assert sum(o.stats.num_accepted_tokens for o in out) > 0
    assert all(not banned & set(o.token_ids) for o in out)
    without = generate(LLM(tiny_model, dtype="float32"), batch, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in without]
