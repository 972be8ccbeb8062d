"""The priority scheduling policy on the fake executor (torch-free): the waiting queue in
(priority, arrival) order, the worst-ranked running request preempted first, and a waiting
request that outranks running ones preempting them for room."""

from __future__ import annotations

import random

import pytest
from fake_executor import expected_continuation, make_core, make_request, run_steps


def finish_order(core) -> list[str]:
    order = []
    while core.has_work():
        order.extend(o.req_id for o in core.step().outputs if o.finished)
    core.check_integrity()
    return order


def test_waiting_requests_run_by_priority_then_arrival() -> None:
    core = make_core(max_num_seqs=1, scheduling_policy="priority")
    reqs = [make_request([i + 1] * 3, max_tokens=2, priority=p)
            for i, p in enumerate([2, 0, 1, 0, -3])]
    for r in reqs:
        core.add_request(r)
    assert finish_order(core) == [reqs[i].req_id for i in (4, 1, 3, 2, 0)]


def test_fcfs_ignores_priority() -> None:
    core = make_core(max_num_seqs=1)
    reqs = [make_request([i + 1] * 3, max_tokens=2, priority=p)
            for i, p in enumerate([2, 0, 1])]
    for r in reqs:
        core.add_request(r)
    assert finish_order(core) == [r.req_id for r in reqs]


def test_the_lowest_priority_running_request_is_preempted() -> None:
    core = make_core(num_blocks=6, block_size=4, scheduling_policy="priority")
    a = make_request([1] * 8, max_tokens=8, priority=0)
    b = make_request([2] * 7, max_tokens=8, priority=5)  # the worst rank, not the latest
    c = make_request([3] * 7, max_tokens=8, priority=1)
    for r in (a, b, c):
        core.add_request(r)
    core.step()  # 6 blocks, all taken: a's next token needs a seventh
    out = core.step()
    assert out.iteration_stats.num_preemptions == 1
    assert [r.req_id for r in core.scheduler.running] == [a.req_id, c.req_id]
    assert [r.req_id for r in core.scheduler.waiting if not r.is_finished] == [b.req_id]
    run = run_steps(core)
    for r in (a, b, c):
        assert run.tokens[r.req_id][-1] == expected_continuation(list(r.prompt_token_ids), 8)[-1]


@pytest.mark.parametrize("late_priority", [0, 3])
def test_a_waiting_request_preempts_only_lower_priority_running_ones(late_priority) -> None:
    core = make_core(num_blocks=4, block_size=4, max_num_seqs=8, scheduling_policy="priority")
    a = make_request([1] * 8, max_tokens=4, priority=3)
    b = make_request([2] * 8, max_tokens=4, priority=3)
    core.add_request(a)
    core.add_request(b)
    core.step()  # both prefilled: 2 blocks each, the pool full
    late = make_request([3] * 3, max_tokens=4, priority=late_priority)
    core.add_request(late)
    out = core.step()
    # b goes either way: for late when late outranks it, else for a's growth; never a
    assert out.iteration_stats.num_preemptions == 1
    running = [r.req_id for r in core.scheduler.running]
    waiting = [r.req_id for r in core.scheduler.waiting if not r.is_finished]
    if late_priority < 3:
        assert running == [late.req_id, a.req_id] and waiting == [b.req_id]
        assert run_steps(core).finished[late.req_id].counters.num_preemptions == 0
    else:
        assert running == [a.req_id] and waiting == [b.req_id, late.req_id]
        run_steps(core)


def test_random_priorities_give_exact_outputs_and_leak_nothing() -> None:
    rng = random.Random(7)
    core = make_core(num_blocks=16, block_size=4, max_num_batched_tokens=16,
                     scheduling_policy="priority")
    reqs, tokens, preemptions = [], {}, 0
    for step in range(400):
        if step < 120 and rng.random() < 0.5:
            prompt = [rng.randrange(1, 900) for _ in range(rng.randrange(2, 20))]
            req = make_request(prompt, max_tokens=rng.randrange(1, 16),
                               priority=rng.randrange(-2, 3))
            core.add_request(req)
            reqs.append(req)
        if step % 7 == 3 and reqs:
            core.abort_requests([rng.choice(reqs).req_id])
        out = core.step()
        preemptions += out.iteration_stats.num_preemptions if out.iteration_stats else 0
        for o in out.outputs:
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
        ranks = [(r.priority, r.arrival) for r in core.scheduler.running]
        assert ranks == sorted(ranks)
        core.kv.check_integrity()
    assert not core.has_work()
    core.check_integrity()
    assert preemptions > 0
    for r in reqs:
        got = tokens.get(r.req_id, [])
        assert got == expected_continuation(list(r.prompt_token_ids), len(got))
