"""Least-token-load ranking of replicas, free of Ray (the router in ``router`` uses it)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from tokenmill.ray_serve.load import TOKEN_LOAD


class HasRoutingStats(Protocol):
    @property
    def routing_stats(self) -> Mapping[str, object]: ...


R = TypeVar("R", bound=HasRoutingStats)


def rank_by_token_load(replicas: Sequence[R], rng: random.Random) -> list[list[R]] | None:
    """One rank per replica, least ``token_load`` first, equal loads in random order.

    ``None`` when any replica has not reported its load yet: the caller then falls back
    to Serve's default choice rather than trusting a partial picture.
    """
    loads = [r.routing_stats.get(TOKEN_LOAD) for r in replicas]
    if not replicas or any(load is None for load in loads):
        return None
    order = list(range(len(replicas)))
    rng.shuffle(order)  # a stable sort keeps this random order among equal loads
    order.sort(key=lambda i: loads[i])
    return [[replicas[i]] for i in order]
