"""Structured outputs through the whole engine on the tiny random-weight model: the
output of a random model under a grammar is still always valid, and everything else
stays true beside it: free rows in the same batch are untouched, and chunked prefill,
preemption (the grammar state survives recompute), prefix caching, n > 1 and
speculative decoding leave a constrained output as it is."""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams, StructuredOutput
from tokenmill.core.records import FinishReason

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json", json.dumps(SCHEMA))
REGEX = StructuredOutput("regex", r"(ab|cd|e)[a-e]{0,30}\.")
GRAMMAR = StructuredOutput("grammar", 'start: ("ab" | "cd" | " ")+ "."')
GRAMMAR_AS_REGEX = r"(ab|cd| )+\."
MAX_TOKENS = 64


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


def check(output, constraint: StructuredOutput) -> None:
    """A finished constrained output is valid; one cut by max_tokens says length."""
    if output.finish_reason == FinishReason.LENGTH.value:
        assert len(output.token_ids) == MAX_TOKENS
        return
    assert output.finish_reason == "stop", output
    if constraint.kind == "json":
        jsonschema.validate(json.loads(output.text), json.loads(constraint.spec))
    else:
        pattern = GRAMMAR_AS_REGEX if constraint.kind == "grammar" else constraint.spec
        assert re.fullmatch(pattern, output.text), output.text


def generate(llm: LLM, batch, params_list):
    outputs = llm.generate(batch, params_list)
    llm.client.core.check_integrity()
    return [o.outputs for o in outputs]


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model, dtype="float32")


def test_constrained_and_free_rows_in_one_batch(llm) -> None:
    batch = prompts(9)
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o[0].token_ids for o in generate(llm, batch, free)]
    mixed = [free if i % 3 == 0 else
             SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS,
                            structured_output=JSON if i % 3 == 1 else REGEX)
             for i in range(len(batch))]
    outputs = generate(llm, batch, mixed)
    for i, out in enumerate(outputs):
        if i % 3 == 0:
            assert out[0].token_ids == alone[i], "a free row is untouched by its neighbours"
        else:
            check(out[0], mixed[i].structured_output)
    assert sum(out[0].finish_reason == "stop" for i, out in enumerate(outputs) if i % 3) >= 3


def test_n_choices_are_each_valid(llm) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                            structured_output=JSON, logprobs=2)
    [choices] = generate(llm, prompts(1, seed=5), params)
    assert len(choices) == 4 and len({c.text for c in choices}) > 1
    for choice in choices:
        check(choice, JSON)
        assert len(choice.logprobs) == len(choice.token_ids)
        assert all(entry.logprob > float("-inf") for entry in choice.logprobs)


def repetitive_prompts(count: int, seed: int = 7) -> list[list[int]]:
    """Phrases said several times over (the n-gram lookup finds drafts in them); two of
    them share a prefix (a prefix-cache hit)."""
    rng = random.Random(seed)
    batch = [[rng.randrange(3, 400) for _ in range(rng.randrange(3, 6))] * 5
             for _ in range(count)]
    batch[3] = batch[1][:12] + batch[3][:8]
    return batch


SCHEDULE_BATCH = repetitive_prompts(8)
SCHEDULE_PARAMS = [
    SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=MAX_TOKENS,
                   structured_output=(JSON, REGEX, GRAMMAR)[i % 3])
    for i in range(len(SCHEDULE_BATCH))]
SCHEDULES = {
    "chunked_prefill+preemption": {"num_kv_blocks": 40, "block_size": 4, "max_model_len": 140,
                                   "max_num_batched_tokens": 16},
    "speculative+no_prefix_cache": {"speculative_ngram": 4, "ngram_min": 1, "ngram_max": 3,
                                    "speculative_disable_by_batch_size": 64,
                                    "enable_prefix_caching": False},
}


@pytest.fixture(scope="module")
def reference(llm):
    return generate(llm, SCHEDULE_BATCH, SCHEDULE_PARAMS)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules_leave_constrained_outputs_unchanged(tiny_model, reference, schedule) -> None:
    """The same tokens (greedy rows, and seeded sampling rows) as the default engine (which
    finds a prefix-cache hit) under chunked prefill and preemption (the grammar state
    survives recompute), and with speculative decoding and no prefix cache (drafts the
    grammar rejects are never verified, so a constrained output never takes one)."""
    other = LLM(tiny_model, dtype="float32", **SCHEDULES[schedule])
    outputs = generate(other, SCHEDULE_BATCH, SCHEDULE_PARAMS)
    for ref, out, p in zip(reference, outputs, SCHEDULE_PARAMS, strict=True):
        assert out[0].token_ids == ref[0].token_ids
        check(out[0], p.structured_output)
    if "num_kv_blocks" in SCHEDULES[schedule]:
        assert sum(o[0].stats.num_preemptions for o in outputs) > 0
    if "speculative_ngram" in SCHEDULES[schedule]:
        assert sum(o[0].stats.num_draft_tokens for o in outputs) > 0, "drafts were verified"


def test_a_grammar_ends_the_request_without_eos(llm) -> None:
    choices = StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma"]))
    params = SamplingParams(temperature=1.0, seed=11, n=8, max_tokens=20, ignore_eos=True,
                            min_tokens=2, structured_output=choices)
    [outs] = generate(llm, prompts(1), params)
    assert {o.text for o in outs} <= {"alpha", "beta", "gamma"}
    assert all(o.finish_reason == "stop" for o in outs)


def test_a_slow_grammar_holds_up_only_its_own_request(tiny_model) -> None:
    """A compilation past ``structured_output_compile_timeout`` fails its request with the
    reason; the free requests beside it run meanwhile, as they would alone."""
    llm = LLM(tiny_model, dtype="float32", structured_output_compile_timeout=0.3)
    compile_now = llm.client.core.grammars._compile

    def slow_compile(constraint):
        time.sleep(1.0)
        return compile_now(constraint)

    llm.client.core.grammars._compile = slow_compile
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batch = prompts(3, seed=9)
    alone = [o[0].token_ids for o in generate(llm, batch, free)]
    start = time.monotonic()
    slow = SamplingParams(temperature=0.0, max_tokens=8, structured_output=StructuredOutput(
        "regex", "[a-z]+"))
    outputs = generate(llm, batch + [batch[0]], [free] * 3 + [slow])
    assert [o[0].token_ids for o in outputs[:3]] == alone
    assert outputs[3][0].finish_reason == "error" and outputs[3][0].token_ids == []
    assert time.monotonic() - start < 1.0, "nobody waited for the slow compilation"
