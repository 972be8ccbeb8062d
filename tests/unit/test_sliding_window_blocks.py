"""A model whose every layer has a sliding window: the KV blocks behind the window go back
to the pool while the request runs, and no step reads one of them (the fake model reads
exactly the positions the window shows, through the block table)."""

from __future__ import annotations

import random

import pytest
from fake_executor import (
    VOCAB,
    expected_continuation,
    make_core,
    make_request,
    run_steps,
    run_to_completion,
)

from tokenmill.core.kv_cache.manager import BEHIND_WINDOW

WINDOW = 6


def window_sum(sequence) -> int:
    """The next token from the last WINDOW tokens only, as a windowed model sees them."""
    return sum(sequence[-WINDOW:]) % VOCAB


SCHEDULES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_blocks": 14},
    "no_prefix_cache": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_windowed_requests_compute_exactly_with_blocks_released(schedule) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 900) for _ in range(rng.randrange(2, 60))] for _ in range(8)]
    prompts[3] = prompts[1][:20] + prompts[3]  # a prefix-cache hit
    options = {"num_blocks": 64, **SCHEDULES[schedule]}
    core = make_core(block_size=4, next_token=window_sum, window=WINDOW, **options)
    requests = [make_request(p, max_tokens=30) for p in prompts]
    for request in requests:
        core.add_request(request)
    got = run_to_completion(core)
    for request, prompt in zip(requests, prompts, strict=True):
        assert got[request.req_id] == expected_continuation(prompt, 30, window_sum)
    assert core.kv.pool.num_used_blocks == 0


def test_a_long_request_holds_only_its_window() -> None:
    """A 400-token prompt and 100 tokens with a window of 6 over blocks of 4: at most the
    window's blocks (plus the one being filled and the chunk's) are ever held, where
    without a window the request ends holding 125."""
    prompt = list(range(1, 401))
    held = {}
    for window in (WINDOW, None):
        core = make_core(num_blocks=200, block_size=4, max_model_len=1024,
                         next_token=window_sum, window=window, max_num_batched_tokens=32)
        request = make_request(prompt, max_tokens=100)
        core.add_request(request)
        peak = 0
        while core.has_work():
            core.step()
            core.kv.check_integrity()
            peak = max(peak, core.kv.pool.num_used_blocks)
            table = core.kv._tables.get(request.req_id, [])
            assert all(b is BEHIND_WINDOW for b in table[: len(table) - peak])
        held[window] = peak
    assert held[None] == 125
    assert held[WINDOW] <= -(-(WINDOW + 32) // 4) + 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_with_released_blocks_recomputes_exactly(prefix_caching: bool) -> None:
    """A preempted request gives back its blocks (none of the released ones twice) and
    recomputes from its first token."""
    core = make_core(num_blocks=5, block_size=4, max_model_len=16, next_token=window_sum,
                     window=WINDOW, enable_prefix_caching=prefix_caching)
    requests = [make_request([i + 1] * 3, max_tokens=13) for i in range(4)]
    for request in requests:
        core.add_request(request)
    run = run_steps(core)
    assert run.preemptions > 0
    for request in requests:
        assert run.tokens[request.req_id] == expected_continuation(
            list(request.prompt_token_ids), 13, window_sum)
