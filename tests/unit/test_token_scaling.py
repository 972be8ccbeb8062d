"""The token-load autoscaling policy, router ranking and load sink, without Ray."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from tokenmill.core.records import SchedulerStats
from tokenmill.ray_serve.load import TokenLoad
from tokenmill.ray_serve.policy import TokenLoadPolicy, desired_replicas
from tokenmill.ray_serve.ranking import EQUAL_LOAD_TOKENS, rank_by_token_load


def _stats(kv: int, waiting: int) -> SchedulerStats:
    return SchedulerStats(num_running=1, num_waiting=1, kv_cache_usage=0.5,
                          kv_cache_tokens_used=kv, num_tokens_waiting=waiting,
                          num_tokens_waiting_raw=waiting + 7)


def test_load_is_kv_tokens_plus_tokens_waiting_of_the_latest_step():
    load = TokenLoad()
    assert load.stats() == {"kv_cache_tokens_used": 0, "num_tokens_waiting": 0, "token_load": 0}
    load.record_step(_stats(160, 40), None)
    load.record_step(_stats(320, 96), None)
    assert load.stats() == {"kv_cache_tokens_used": 320, "num_tokens_waiting": 96,
                            "token_load": 416}


@pytest.mark.parametrize(("total", "expected"), [
    (0, 1), (1, 1), (1000, 1), (1001, 2), (2000, 2), (2001, 3), (10_000, 4)])
def test_desired_replicas_is_ceil_of_load_over_target_within_bounds(total, expected):
    assert desired_replicas(total, 1000, min_replicas=1, max_replicas=4) == expected


def test_desired_replicas_respects_the_minimum_and_rejects_a_bad_target():
    assert desired_replicas(0, 1000, min_replicas=2, max_replicas=4) == 2
    with pytest.raises(ValueError):
        desired_replicas(10, 0, 1, 2)


def _ctx(loads: dict[str, float] | None, target: int = 1, lo: int = 1, hi: int = 8):
    metrics = None if loads is None else {"token_load": loads}
    return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=target,
                           capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
                           policy_state={"kept": True})


def test_policy_sums_the_replicas_token_load():
    policy = TokenLoadPolicy(target_tokens_per_replica=500)
    replicas, state = policy(_ctx({"a": 900.0, "b": 700.0}))
    assert replicas == 4  # ceil(1600 / 500)
    assert state == {"kept": True, "total_token_load": 1600.0}
    assert policy(_ctx({"a": 900.0, "b": 700.0}, hi=3))[0] == 3
    assert policy(_ctx({"a": 0.0, "b": 0.0}, target=2))[0] == 1


def test_policy_keeps_the_current_target_without_reports():
    policy = TokenLoadPolicy(target_tokens_per_replica=500)
    assert policy(_ctx(None, target=3))[0] == 3
    assert policy(_ctx({}, target=2))[0] == 2


def _replica(name: str, **stats) -> SimpleNamespace:
    return SimpleNamespace(name=name, routing_stats=stats)


def test_ranking_puts_the_least_loaded_replica_first():
    replicas = [_replica("a", token_load=900), _replica("b", token_load=10),
                _replica("c", token_load=300)]
    ranked = rank_by_token_load(replicas, random.Random(0))
    assert [[r.name for r in rank] for rank in ranked] == [["b"], ["c"], ["a"]]


def test_ranking_puts_nearly_equal_loads_in_one_rank_in_random_order():
    replicas = [_replica("a", token_load=5), _replica("b", token_load=5 + EQUAL_LOAD_TOKENS),
                _replica("c", token_load=5), _replica("d", token_load=6 + EQUAL_LOAD_TOKENS)]
    rng = random.Random(1)
    ranks = [rank_by_token_load(replicas, rng) for _ in range(600)]
    assert all(sorted(r.name for r in ranked[0]) == ["a", "b", "c"] for ranked in ranks)
    assert all([r.name for r in ranked[1]] == ["d"] for ranked in ranks)
    firsts = Counter(ranked[0][0].name for ranked in ranks)
    assert set(firsts) == {"a", "b", "c"}
    assert min(firsts.values()) > 150


def test_ranking_gives_up_when_a_replica_has_not_reported():
    replicas = [_replica("a", token_load=1), _replica("b")]
    assert rank_by_token_load(replicas, random.Random(0)) is None
    assert rank_by_token_load([], random.Random(0)) is None
