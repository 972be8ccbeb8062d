"""The whole engine (scheduler + paged KV cache + model runner + sampler) against
Hugging Face transformers' greedy search on the same weights, under every scheduling
path: batching, chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.records import FinishReason
from tokenmill.engine.messages import StepReport
from tokenmill.errors import InvalidParameterError

NUM_TOKENS = 24


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(3, 70))] for _ in range(count)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)

SCHEDULES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "no_chunked_prefill": {"enable_chunked_prefill": False, "max_num_batched_tokens": 128,
                           "max_model_len": 128},
    "preemption": {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 48},
    "no_prefix_cache": {"enable_prefix_caching": False, "max_num_seqs": 3},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_greedy_tokens_equal_transformers(tiny_model, hf_greedy, schedule) -> None:
    """32 concurrent requests of mixed lengths each get exactly what they get alone."""
    options = SCHEDULES[schedule]
    llm = LLM(tiny_model, dtype="float32", **options)
    batch = prompts(32)
    batch[5] = batch[3][:len(batch[3]) // 2] + batch[5]  # shares a prefix: a cache hit
    if "num_kv_blocks" in options:
        batch = [p[:20] for p in batch]
    outputs = llm.generate(batch, GREEDY)
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == hf_greedy(prompt, NUM_TOKENS)
    llm.client.core.check_integrity()
    if schedule == "preemption":
        assert sum(o.outputs[0].stats.num_preemptions for o in outputs) > 0


def test_prefix_cache_hit_keeps_output_identical(tiny_model, hf_greedy) -> None:
    llm = LLM(tiny_model, dtype="float32", block_size=4)
    shared = list(range(10, 50)) + [7] * 8  # 12 full blocks of 4
    first = llm.generate([shared], GREEDY)[0]
    second = llm.generate([shared + [9, 9]], GREEDY)[0]
    assert first.outputs[0].stats.num_cached_tokens == 0
    assert second.num_cached_tokens == 48
    assert second.outputs[0].token_ids == hf_greedy(shared + [9, 9], NUM_TOKENS)


def test_parallel_sampling_and_seeds(tiny_model) -> None:
    llm = LLM(tiny_model, dtype="float32")
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    [a] = llm.generate(["Once upon a time"], params)
    [b] = llm.generate(["Once upon a time"], params)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # choices differ
    # the seed fixes a request's tokens whatever else shares its batch
    crowd = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 4
    mixed = llm.generate(["noise"] * 4 + ["Once upon a time"],
                         [*crowd, SamplingParams(temperature=1.0, seed=11, max_tokens=12,
                                                 ignore_eos=True)])
    assert mixed[-1].outputs[0].token_ids == a.outputs[0].token_ids


def test_stop_strings_and_stats(tiny_model) -> None:
    llm = LLM(tiny_model, dtype="float32")
    [full] = llm.generate(["The cat sat"], GREEDY)
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    [cut] = llm.generate(["The cat sat"], SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                                          ignore_eos=True, stop=[stop]))
    assert cut.outputs[0].finish_reason == FinishReason.STOP.value
    assert cut.outputs[0].text == text[:text.index(stop)]
    assert cut.outputs[0].stop_reason == stop
    stats = full.outputs[0].stats
    assert stats.num_generation_tokens == NUM_TOKENS and stats.finish_reason is FinishReason.LENGTH
    assert 0 <= stats.queue_time <= stats.time_to_first_token <= stats.e2e_latency
    llm.client.core.check_integrity()


@pytest.mark.parametrize("options", [{}, {"speculative_ngram": 3}])
def test_the_engine_stops_on_the_token_that_completes_a_stop_string(tiny_model, options) -> None:
    """The engine computes no token past a stop string: what it generates for the request
    ends with the token whose text completes it, and the offline output shows that."""
    llm = LLM(tiny_model, dtype="float32", **options)
    prompt = prompts(1, seed=5)[0]
    [full] = llm.generate([prompt], GREEDY)
    ids, text = full.outputs[0].token_ids, full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    completes = next(k for k in range(1, len(ids) + 1) if stop in llm.tokenizer.decode(ids[:k]))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[stop])
    [request] = llm.processor.make_core_requests("stop-at-its-token", prompt, params)
    llm.client.add_request(request)
    generated, final = [], None
    while final is None:
        report = llm.client.get_output()
        if isinstance(report, StepReport):
            for out in report.outputs.outputs:
                generated += out.new_token_ids
                final = out if out.finished else None
    assert final.finish_reason is FinishReason.STOP and generated == ids[:completes]
    [cut] = llm.generate([prompt], params)
    assert cut.outputs[0].token_ids == ids[:completes]
    assert cut.outputs[0].text == text[:text.index(stop)]
    assert cut.outputs[0].stats.num_generation_tokens == completes
    *with_tokens, finish = llm.stream(prompt, params)  # the stop's token, then the finish
    assert sum(len(d.token_ids) for d in with_tokens) == completes
    assert all(d.finish_reason is None for d in with_tokens)
    assert (finish.token_ids, finish.text, finish.finish_reason, finish.stop_reason) == (
        (), "", "stop", stop)
    llm.client.core.check_integrity()


def test_abandoned_stream_frees_blocks(tiny_model) -> None:
    llm = LLM(tiny_model, dtype="float32")
    stream = llm.stream("abandon me", GREEDY)
    next(stream)
    stream.close()
    llm.client.core.check_integrity()
    assert llm.client.core.kv.pool.num_used_blocks == 0


def test_a_failed_step_raises_and_frees_the_requests_left(tiny_model) -> None:
    """One request runs at a time; the third step fails: ``generate`` raises, the failed
    request and those still waiting are gone from the engine, and the next call runs."""
    llm = LLM(tiny_model, dtype="float32", max_num_seqs=1)
    runner = llm.client.core.executor

    class FailsOnce:
        calls = 0

        def execute(self, scheduler_output):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("device lost")
            return runner.execute(scheduler_output)

    llm.client.core.executor = FailsOnce()
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(prompts(3), GREEDY)
    llm.client.core.check_integrity()
    assert llm.client.core.kv.pool.num_used_blocks == 0
    [again] = llm.generate(prompts(1), GREEDY)
    assert len(again.outputs[0].token_ids) == NUM_TOKENS


def test_bad_options_and_prompts_raise_clear_errors(tiny_model) -> None:
    with pytest.raises(InvalidParameterError, match="max_num_seqs"):
        LLM(tiny_model, max_num_seqs=0)
    with pytest.raises(InvalidParameterError, match="unknown engine option"):
        LLM(tiny_model, max_num_sequences=4)
    llm = LLM(tiny_model, dtype="float32", max_model_len=64)
    with pytest.raises(InvalidParameterError) as info:
        llm.generate(["hi"], SamplingParams(max_tokens=100))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidParameterError):
        llm.generate([[1, 2, 10_000]], GREEDY)
    llm.client.core.check_integrity()


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_an_8_bit_kv_cache_holds_more_tokens_in_the_same_memory(tiny_model, kernels) -> None:
    """``--kv-cache-dtype int8``: a float32 model's heads of D values take D + 4 bytes a
    row instead of 4 D, so the same memory holds that many times the blocks; every
    scheduling path runs on it (prefix hits, chunks, preemption) and frees every block."""
    memory = 1 << 20
    plain = LLM(tiny_model, dtype="float32", kv_cache_memory=memory, kernels=kernels)
    small = LLM(tiny_model, dtype="float32", kv_cache_memory=memory, kernels=kernels,
                kv_cache_dtype="int8")
    config = plain.client.core.executor.model.config
    rows = 2 * config.num_key_value_heads * config.num_hidden_layers * 16  # a block's
    assert plain.client.info.kv_cache_tokens == memory // (rows * 4 * config.head_dim) * 16
    assert small.client.info.kv_cache_tokens == memory // (rows * (config.head_dim + 4)) * 16
    batch = [p[:20] for p in prompts(8, seed=3)]  # within the preemption schedule's 48
    for options in SCHEDULES.values():
        llm = LLM(tiny_model, dtype="float32", kernels=kernels, kv_cache_dtype="int8",
                  **options)
        outputs = llm.generate(batch + batch[:2], GREEDY)  # the last two: prefix hits
        assert [len(o.outputs[0].token_ids) for o in outputs] == [NUM_TOKENS] * 10
        assert outputs[8].outputs[0].token_ids == outputs[0].outputs[0].token_ids
        llm.client.core.check_integrity()
        assert llm.client.core.kv.pool.num_used_blocks == 0
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype"):
        LLM(tiny_model, kv_cache_dtype="fp8")
