"""Speculative decoding in the engine core, torch-free: n-gram proposals, and the
scheduler's drafts against a fake model that verifies them (fake_executor.py)."""

from __future__ import annotations

import random

import pytest
from fake_executor import VOCAB, expected_continuation, make_core, make_request

from tokenmill.core.records import FinishReason
from tokenmill.core.spec_decode import NgramProposer


def test_proposer_drafts_what_followed_the_longest_match() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 8, 5, 2, 3, 7, 2, 3]
    # "2 3" ends at 2 (then 9 8 5) and at 7 (then 7 2 3); "1 2 3" does not recur,
    # "2 3" is the longest match; the most recent with 3 tokens after it wins.
    assert proposer.propose(tokens, max_drafts=8) == (7, 2, 3)
    assert proposer.propose(tokens + [5, 2], max_drafts=8) == (3, 7, 2)  # "5 2" at 5..6
    assert proposer.propose(tokens, max_drafts=2) == (7, 2)
    assert proposer.propose(tokens, max_drafts=0) == ()
    assert proposer.propose([4, 5, 6], max_drafts=8) == ()  # no earlier 6


def test_proposer_respects_min_n_and_takes_a_short_tail_only_when_nothing_longer() -> None:
    assert NgramProposer(3, min_n=2, max_n=4).propose([1, 5, 2, 5], max_drafts=3) == ()
    assert NgramProposer(3, min_n=1, max_n=4).propose([1, 5, 2, 5], max_drafts=3) == (2, 5)
    # a run of one token: the earliest match has the most tokens after it
    assert NgramProposer(4, min_n=2, max_n=3).propose([7] * 4, max_drafts=4) == (7,)
    assert NgramProposer(2, min_n=2, max_n=3).propose([7] * 6, max_drafts=4) == (7, 7)


def periodic_model(sequence) -> int:
    """Repeats the token five back, except at every 7th position: drafts from the
    prompt are often right and sometimes wrong."""
    if len(sequence) % 7:
        return sequence[-5]
    return sum(sequence) % VOCAB


SCHEDULES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "preemption": {"num_blocks": 20},
    "no_prefix_cache": {"enable_prefix_caching": False, "max_num_seqs": 3},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_speculative_outputs_equal_plain_decoding(schedule) -> None:
    """Every request gets exactly the model's continuation; drafts are both accepted and
    rejected; a request never holds a block past its last token after a step."""
    core = make_core(next_token=periodic_model, speculative_ngram=3, ngram_min=1,
                     speculative_disable_by_batch_size=64, **SCHEDULES[schedule])
    rng = random.Random(1)
    requests = []
    for _ in range(12):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(6, 14))]
        requests.append(make_request(prompt, max_tokens=rng.randrange(5, 30)))
        core.add_request(requests[-1])
    tokens: dict[str, list[int]] = {}
    drafts = accepted = preemptions = 0
    while core.has_work():
        step = core.step()
        for out in step.outputs:
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        if step.iteration_stats:
            drafts += step.iteration_stats.num_draft_tokens
            accepted += step.iteration_stats.num_accepted_tokens
            preemptions += step.iteration_stats.num_preemptions
        core.kv.check_integrity()
        for request in core.scheduler.running:
            assert len(core.kv.block_ids(request.req_id)) <= -(-request.num_tokens // 4)
    core.check_integrity()
    for request in requests:
        params = request.sampling_params
        assert tokens[request.req_id] == expected_continuation(
            list(request.prompt_token_ids), params.max_tokens, periodic_model)
    assert 0 < accepted < drafts
    if schedule == "preemption":
        assert preemptions > 0


def test_drafts_never_pass_max_tokens_or_max_model_len() -> None:
    core = make_core(next_token=periodic_model, max_model_len=40, speculative_ngram=8,
                     ngram_min=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    short = make_request(prompt, max_tokens=6)
    long = make_request(prompt + [8], max_tokens=100)
    core.add_request(short)
    core.add_request(long)
    outputs = {}
    while core.has_work():
        for out in core.step().outputs:
            outputs.setdefault(out.req_id, []).append(out)
        assert all(r.num_tokens <= 40 for r in core.scheduler.running)
    assert sum(len(o.new_token_ids) for o in outputs[short.req_id]) == 6
    assert outputs[short.req_id][-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outputs[long.req_id]) == 40 - len(prompt) - 1
    assert outputs[long.req_id][-1].finish_reason is FinishReason.LENGTH
    assert max(len(o.new_token_ids) for o in outputs[long.req_id]) > 1


def test_no_drafts_while_the_batch_is_larger_than_the_limit() -> None:
    core = make_core(next_token=periodic_model, speculative_ngram=3, ngram_min=1,
                     speculative_disable_by_batch_size=2)
    for i in range(3):
        core.add_request(make_request([5 + i, 6, 7, 8, 9, 5 + i, 6, 7], max_tokens=12))
    while core.has_work():
        num_running = len(core.scheduler.running)
        stats = core.step().iteration_stats
        if num_running > 2:
            assert stats.num_draft_tokens == 0
    core.check_integrity()


def test_stop_token_inside_accepted_drafts_stops_there() -> None:
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    expected = expected_continuation(prompt, 30, periodic_model)
    stop = expected[3]  # drafted (with the tokens before it) from the prompt's 14 15 16 17
    assert stop not in expected[:3]
    core = make_core(next_token=periodic_model, speculative_ngram=4, ngram_min=1)
    request = make_request(prompt, max_tokens=30, stop_token_ids=[stop])
    core.add_request(request)
    tokens, finish, sizes = [], None, []
    while core.has_work():
        for out in core.step().outputs:
            tokens += out.new_token_ids
            sizes.append(len(out.new_token_ids))
            finish = out.finish_reason
    assert tokens == expected[:4]
    assert finish is FinishReason.STOP
    assert sizes[-1] > 1  # the stop token came within a multi-token step
    core.check_integrity()
