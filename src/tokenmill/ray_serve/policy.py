"""Token-load autoscaling for Ray Serve: replicas = ceil(total token load / target).

Ray Serve calls ``TokenLoadPolicy(ctx)`` on every control-loop tick with each running
replica's ``token_load`` (reported by ``record_autoscaling_stats``, averaged over
``look_back_period_s``). Serve itself then applies ``upscale_delay_s`` /
``downscale_delay_s``, the up/down scaling factors and the min/max bounds to the answer.
This module imports nothing from Ray: Serve pickles it by value into its controller.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

TOKEN_LOAD = "token_load"  # the key of ``load.TokenLoad.stats()``


def desired_replicas(total_token_load: float, target_per_replica: float,
                     min_replicas: int, max_replicas: int) -> int:
    """``ceil(total / target)`` within ``[min_replicas, max_replicas]``."""
    if target_per_replica <= 0:
        raise ValueError(f"target tokens per replica must be positive, got {target_per_replica}")
    wanted = math.ceil(total_token_load / target_per_replica)
    return max(min_replicas, min(max_replicas, wanted))


def total_token_load(per_replica: Iterable[float]) -> float:
    return float(sum(per_replica))


class TokenLoadPolicy:
    """A Ray Serve autoscaling policy class (``AutoscalingPolicy(policy_function=...,
    policy_kwargs={"target_tokens_per_replica": T})``)."""

    def __init__(self, target_tokens_per_replica: float) -> None:
        if target_tokens_per_replica <= 0:
            raise ValueError("target_tokens_per_replica must be positive")
        self.target = target_tokens_per_replica

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """``ctx`` is Serve's ``AutoscalingContext``; replicas with no report yet count 0.

        With no report at all (replicas starting), keep the current target.
        """
        loads = (ctx.aggregated_metrics or {}).get(TOKEN_LOAD)
        if not loads:
            return ctx.target_num_replicas, ctx.policy_state
        total = total_token_load(loads.values())
        wanted = desired_replicas(total, self.target, ctx.capacity_adjusted_min_replicas,
                                  ctx.capacity_adjusted_max_replicas)
        return wanted, {**ctx.policy_state, "total_token_load": total}
