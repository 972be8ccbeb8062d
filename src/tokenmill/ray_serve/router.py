"""``TokenLoadRequestRouter``: send each request to the replica with the least token load.

Each replica's ``record_routing_stats`` reports its ``token_load`` every
``request_routing_stats_period_s``; this router ranks the candidates by it, replicas with
nearly equal loads sharing a rank (``ranking``). Serve then tries the ranks in order and,
within a rank, picks the replica with the fewest requests in flight (its own count,
fresher than any report), skipping a replica whose ``max_ongoing_requests`` is reached.
Until every candidate has reported, it routes as Serve's default router does (power of
two choices on queue length).
"""

from __future__ import annotations

import random

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from tokenmill.ray_serve.ranking import rank_by_token_load


class TokenLoadRequestRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._rng = random.Random()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        ranked = rank_by_token_load(candidate_replicas, self._rng)
        if ranked is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        return ranked
