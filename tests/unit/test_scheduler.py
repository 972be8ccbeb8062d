from __future__ import annotations

import random

import pytest
from fake_executor import (
    EOS,
    FakeExecutor,
    expected_continuation,
    make_core,
    make_request,
    run_steps,
    run_to_completion,
)

from tokenmill.core.records import FinishReason, RequestEventType


def test_single_request_computes_exact_continuation() -> None:
    core = make_core()
    req = make_request([5, 6, 7, 8, 9], max_tokens=6)
    core.add_request(req)
    tokens = run_to_completion(core)
    assert tokens[req.req_id] == expected_continuation([5, 6, 7, 8, 9], 6)


def test_chunked_prefill_keeps_decodes_running_and_respects_budget() -> None:
    core = make_core(num_blocks=128, max_num_batched_tokens=16)
    short = make_request([1, 2, 3], max_tokens=30)
    core.add_request(short)
    core.step()  # short is now decoding
    long_prompt = list(range(1, 101))
    long = make_request(long_prompt, max_tokens=3)
    core.add_request(long)
    steps_with_long_prefill = 0
    while core.has_work():
        outputs = core.step()
        executor: FakeExecutor = core.executor  # type: ignore[assignment]
        step = executor.steps[-1]
        assert step.num_scheduled_tokens <= 16
        ids = {r.req_id: r for r in step.requests}
        if long.req_id in ids and not ids[long.req_id].sample:
            steps_with_long_prefill += 1
            assert short.req_id in ids, "a decode was blocked by a prompt chunk"
        assert outputs.scheduler_stats.num_running <= 2
        if not core.scheduler.requests.get(short.req_id):
            break
    assert steps_with_long_prefill >= 5  # 100 tokens in chunks of <= 15
    run_to_completion(core)


def test_max_num_seqs_caps_the_batch() -> None:
    core = make_core(max_num_seqs=2)
    for _ in range(5):
        core.add_request(make_request([1, 2], max_tokens=3))
    while core.has_work():
        out = core.step()
        assert out.scheduler_stats.num_running <= 2
        if out.iteration_stats:
            assert out.iteration_stats.batch_size <= 2
    core.check_integrity()


def test_prefix_cache_hit_is_recorded_and_output_unchanged() -> None:
    core = make_core(block_size=4)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    first = make_request(prompt, max_tokens=4)
    core.add_request(first)
    run_to_completion(core)
    second = make_request(prompt, max_tokens=4)
    core.add_request(second)
    outputs = []
    while core.has_work():
        outputs.extend(core.step().outputs)
    assert [t for o in outputs for t in o.new_token_ids] == expected_continuation(prompt, 4)
    assert outputs[-1].num_cached_tokens == 12
    core.check_integrity()


def test_prefix_caching_disabled_gives_no_hits() -> None:
    core = make_core(enable_prefix_caching=False)
    prompt = list(range(10, 23))
    for _ in range(2):
        req = make_request(prompt, max_tokens=2)
        core.add_request(req)
        outputs = []
        while core.has_work():
            outputs.extend(core.step().outputs)
        assert outputs[-1].num_cached_tokens == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_and_never_restreams(prefix_caching: bool) -> None:
    # 40 token slots for 4 x ~20 tokens
    core = make_core(num_blocks=10, block_size=4, enable_prefix_caching=prefix_caching)
    reqs = [make_request([i + 1] * 6, max_tokens=14) for i in range(4)]
    for r in reqs:
        core.add_request(r)
    run = run_steps(core)
    tokens, preemptions, finished = run.tokens, run.preemptions, run.finished
    assert preemptions > 0
    for r in reqs:
        assert tokens[r.req_id] == expected_continuation(list(r.prompt_token_ids), 14)
    assert sum(o.counters.num_preemptions for o in finished.values()) == preemptions
    assert any(o.counters.num_recomputed_tokens > 0 for o in finished.values())


def test_preempted_request_returns_to_front_of_queue() -> None:
    core = make_core(num_blocks=4, block_size=4, max_num_seqs=8)
    a = make_request([1] * 8, max_tokens=8)
    b = make_request([2] * 8, max_tokens=8)
    core.add_request(a)
    core.add_request(b)
    core.step()  # both prefilled: 2 blocks each, pool full
    c = make_request([3] * 3, max_tokens=2)
    core.add_request(c)
    core.step()  # a and b need a third block: b (latest arrival) is preempted
    waiting = [r.req_id for r in core.scheduler.waiting if not r.is_finished]
    assert waiting[0] == b.req_id and waiting[1] == c.req_id
    run_to_completion(core)


def test_abort_frees_blocks_at_once_and_reports_abort() -> None:
    core = make_core()
    running = make_request([1, 2, 3, 4, 5], max_tokens=50)
    waiting = make_request([9] * 5, max_tokens=50)
    core.add_request(running)
    core.step()
    core.add_request(waiting)
    core.abort_requests([running.req_id, waiting.req_id])
    assert core.kv.pool.num_used_blocks == 0
    core.check_integrity()
    out = core.step()
    reasons = {o.req_id: o.finish_reason for o in out.outputs}
    assert reasons == {running.req_id: FinishReason.ABORT, waiting.req_id: FinishReason.ABORT}
    assert out.scheduler_stats.num_waiting == 0 and out.scheduler_stats.num_running == 0
    assert not core.has_work()


def test_lifecycle_events_in_order() -> None:
    core = make_core()
    req = make_request([1, 2, 3], max_tokens=3)
    core.add_request(req)
    events = []
    while core.has_work():
        for o in core.step().outputs:
            events.extend(o.events)
    kinds = [e.type for e in events]
    assert kinds == [
        RequestEventType.QUEUED, RequestEventType.SCHEDULED, RequestEventType.PREFILLING,
        RequestEventType.NEW_TOKENS, RequestEventType.DECODING,
        RequestEventType.NEW_TOKENS, RequestEventType.NEW_TOKENS, RequestEventType.FINISHED,
    ]
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert all(a.ts <= b.ts for a, b in zip(events, events[1:], strict=False))


def test_eos_min_tokens_and_stop_token_ids() -> None:
    core = make_core()
    # sum([EOS - 5, 5]) % 1000 == EOS: the first token is EOS
    core.add_request(make_request([EOS - 5, 5], max_tokens=5, ignore_eos=False))
    out = []
    while core.has_work():
        out.extend(core.step().outputs)
    assert out[-1].finish_reason is FinishReason.STOP and len(out) == 1
    stop_id = expected_continuation([1, 2], 2)[1]
    req = make_request([1, 2], max_tokens=10, stop_token_ids=[stop_id])
    core.add_request(req)
    out = []
    while core.has_work():
        out.extend(core.step().outputs)
    assert [t for o in out for t in o.new_token_ids] == expected_continuation([1, 2], 2)
    assert out[-1].finish_reason is FinishReason.STOP
    # below min_tokens the scheduler asks the sampler to ban EOS and stop ids
    req = make_request([1, 2], max_tokens=10, min_tokens=3, stop_token_ids=[7])
    core.add_request(req)
    core.step()
    step = core.executor.steps[-1]  # type: ignore[attr-defined]
    assert step.requests[0].mask_stop_tokens == frozenset({EOS, 7})
    run_to_completion(core)


def test_max_model_len_finishes_with_length() -> None:
    core = make_core(max_model_len=10)
    req = make_request([1] * 8, max_tokens=100)
    core.add_request(req)
    tokens = run_to_completion(core)
    assert len(tokens[req.req_id]) == 2


def test_parallel_sampling_siblings_share_prompt_blocks() -> None:
    core = make_core(block_size=4)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks
    children = [make_request(prompt, max_tokens=3, group_id="g") for _ in range(3)]
    for c in children:
        core.add_request(c)
    finished = {}
    while core.has_work():
        for o in core.step().outputs:
            if o.finished:
                finished[o.req_id] = o
    cached = sorted(o.num_cached_tokens for o in finished.values())
    assert cached == [0, 16, 16]
    core.check_integrity()


def test_queue_sums_match_brute_force_recount_randomised() -> None:
    rng = random.Random(1234)
    core = make_core(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    shared_prefix = [7] * 8
    live: list[str] = []
    for _ in range(400):
        action = rng.random()
        if action < 0.35:
            prompt = (shared_prefix if rng.random() < 0.5 else []) + [
                rng.randrange(1, 900) for _ in range(rng.randrange(1, 20))]
            req = make_request(prompt, max_tokens=rng.randrange(1, 12))
            core.add_request(req)
            live.append(req.req_id)
        elif action < 0.45 and live:
            core.abort_requests([live.pop(rng.randrange(len(live)))])
        else:
            core.step()
        _check_queue_sums(core)
    run_to_completion(core)
    _check_queue_sums(core)
    assert core.scheduler.num_tokens_waiting == 0


def _check_queue_sums(core) -> None:
    sched = core.scheduler
    waiting = [r for r in sched.waiting if not r.is_finished]
    assert sched.num_waiting == len(waiting)
    raw = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
    assert sched.num_tokens_waiting_raw == raw
    assert sched.num_tokens_waiting == sum(r.queued_tokens for r in waiting)
    for r in waiting:
        assert r.num_computed_tokens == 0
        assert 0 < r.queued_tokens <= r.queued_tokens_raw == r.num_tokens
    core.kv.check_integrity()


def test_steps_that_commit_several_tokens() -> None:
    core = make_core(tokens_per_step=3)
    req = make_request([4, 5, 6], max_tokens=10)
    core.add_request(req)
    outputs = []
    while core.has_work():
        out = core.step()
        outputs.extend(out.outputs)
        if out.iteration_stats:
            assert out.iteration_stats.num_generation_tokens in (0, 1, 3)
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens == expected_continuation([4, 5, 6], 10)
    assert [len(o.new_token_ids) for o in outputs] == [3, 3, 3, 1]  # capped by max_tokens
    counts = [e.num_tokens for o in outputs for e in o.events
              if e.type is RequestEventType.NEW_TOKENS]
    assert counts == [3, 3, 3, 1]
    # a stop token in the middle of a step drops the tokens after it
    stop_id = expected_continuation([1, 2], 5)[3]
    req = make_request([1, 2], max_tokens=10, stop_token_ids=[stop_id])
    core.add_request(req)
    tokens = run_to_completion(core)[req.req_id]
    assert tokens == expected_continuation([1, 2], 4)
