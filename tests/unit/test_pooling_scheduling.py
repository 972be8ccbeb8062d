"""Embedding (pooling) requests in the scheduler, torch-free on the fake executor: chunked
within the token budget beside decodes, pooled across chunks, started over after a
preemption, finished with their blocks freed."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from fake_executor import make_core, make_request

from tokenmill.core.records import FinishReason
from tokenmill.sampling_params import PoolingParams


def pooling_request(prompt: list[int], pooling: PoolingParams):
    return replace(make_request(prompt, max_tokens=1), pooling=pooling)


def expected(prompt: list[int], pooling: PoolingParams) -> list[float]:
    rows = [[float(t), 1.0] for t in prompt]
    vector = {"last": rows[-1], "cls": rows[0],
              "mean": [sum(r[0] for r in rows) / len(rows), 1.0]}[pooling.kind]
    if pooling.normalize:
        norm = math.hypot(*vector)
        vector = [x / norm for x in vector]
    return vector


def run(core) -> dict:
    finished, preemptions = {}, 0
    while core.has_work():
        out = core.step()
        step = core.executor.steps[-1]
        assert step.num_scheduled_tokens <= core.scheduler.max_num_batched_tokens
        preemptions += out.iteration_stats.num_preemptions if out.iteration_stats else 0
        finished.update({o.req_id: o for o in out.outputs if o.finished})
        core.kv.check_integrity()
    core.check_integrity()
    return {"finished": finished, "preemptions": preemptions}


@pytest.mark.parametrize("pooling", [PoolingParams(), PoolingParams("mean"),
                                     PoolingParams("cls", normalize=False)],
                         ids=["last", "mean", "cls-raw"])
def test_chunked_pooling_beside_decodes(pooling) -> None:
    core = make_core(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    decode = make_request([1, 2, 3], max_tokens=20)
    core.add_request(decode)
    core.step()
    prompts = [list(range(10 + i, 40 + i)) for i in range(3)]
    embeds = [pooling_request(p, pooling) for p in prompts]
    for r in embeds:
        core.add_request(r)
    result = run(core)
    for r, prompt in zip(embeds, prompts, strict=True):
        out = result["finished"][r.req_id]
        assert out.finish_reason is FinishReason.STOP and out.new_token_ids == ()
        assert list(out.embedding) == pytest.approx(expected(prompt, pooling))
    steps = core.executor.steps
    assert all(any(i.req_id == decode.req_id for i in s.requests) for s in steps[1:10])


def test_a_preempted_pooling_request_starts_over() -> None:
    core = make_core(num_blocks=10, block_size=4, max_num_batched_tokens=8)
    long = make_request([5] * 8, max_tokens=24)
    core.add_request(long)
    prompt = list(range(100, 132))  # 8 blocks: long's growth preempts it mid-prompt
    embed = pooling_request(prompt, PoolingParams("mean"))
    core.add_request(embed)
    result = run(core)
    out = result["finished"][embed.req_id]
    assert out.counters.num_preemptions > 0
    assert list(out.embedding) == pytest.approx(expected(prompt, PoolingParams("mean")))
    assert result["finished"][long.req_id].counters.num_preemptions == 0
