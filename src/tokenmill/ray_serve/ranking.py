"""Least-token-load ranking of replicas, free of Ray (the router in ``router`` uses it)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from tokenmill.ray_serve.load import TOKEN_LOAD

# Loads this close count as equal: one short request's worth of KV (a few blocks).
EQUAL_LOAD_TOKENS = 64


class HasRoutingStats(Protocol):
    @property
    def routing_stats(self) -> Mapping[str, object]: ...


R = TypeVar("R", bound=HasRoutingStats)


def rank_by_token_load(replicas: Sequence[R], rng: random.Random,
                       equal_within: int = EQUAL_LOAD_TOKENS) -> list[list[R]] | None:
    """Ranks of replicas, least ``token_load`` first.

    A rank holds the replicas whose loads are within ``equal_within`` tokens of its
    least loaded one, in random order; the caller picks among a rank by a fresher signal
    (Serve: fewest requests in flight), so requests that arrive between two load reports
    spread over equally loaded replicas instead of all going to one.

    ``None`` when any replica has not reported its load yet: the caller then falls back
    to Serve's default choice rather than trusting a partial picture.
    """
    loads = [r.routing_stats.get(TOKEN_LOAD) for r in replicas]
    if not replicas or any(load is None for load in loads):
        return None
    ranks: list[list[R]] = []
    floor = None
    for i in sorted(range(len(replicas)), key=lambda i: loads[i]):
        if floor is None or loads[i] > floor + equal_within:
            ranks.append([])
            floor = loads[i]
        ranks[-1].append(replicas[i])
    for rank in ranks:
        rng.shuffle(rank)
    return ranks
