"""``RayConfig``: the ``tokenmill serve --ray`` settings, validated and with their derived
defaults filled in when built. Imports nothing from Ray, so the CLI can offer (and
check) these flags where Ray is not installed."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tokenmill.config import option
from tokenmill.errors import InvalidParameterError

RAY_INSTALL_HINT = "pip install 'tokenmill[ray]'"


@dataclass(frozen=True, slots=True)
class RayConfig:
    """Invariant: ``1 <= min_replicas <= max_replicas`` and ``replica_num_cpus > 0`` (both
    set, never None, once built)."""

    ray: bool = option(False, "serve from Ray Serve replicas instead of one process")
    ray_address: str | None = option(
        None, "join this Ray cluster ('auto': the local one) instead of starting one on "
        "127.0.0.1")
    min_replicas: int = option(1, "replicas to start with and keep")
    max_replicas: int | None = option(None, "most replicas (default: --min-replicas, no "
                                      "autoscaling)")
    target_tokens_per_replica: float = option(
        24576, "autoscale to ceil(sum of KV tokens used + tokens waiting / this)")
    upscale_delay_s: float = option(30.0, "load above target this long adds replicas")
    downscale_delay_s: float = option(300.0, "load below target this long removes replicas")
    look_back_period_s: float = option(
        10.0, "the autoscaler averages each replica's token load over this")
    autoscaling_metrics_interval_s: float = option(
        1.0, "how often replicas report their token load to the autoscaler")
    routing_stats_period_s: float = option(
        0.1, "how often replicas report their token load to the router")
    replica_num_cpus: float | None = option(
        None, "CPUs (and torch threads) per replica (default: this host's cores / "
        "--max-replicas)")
    request_router: str = option(
        "default", "Serve's default (power of two choices on requests in flight), or "
        "token-load (least token load)", choices=("default", "token-load"))
    ray_metrics_export_port: int | None = option(
        None, "where the local Ray instance exports its Prometheus metrics, per-replica "
        "tokenmill gauges included")

    def __post_init__(self) -> None:
        if self.max_replicas is None:
            object.__setattr__(self, "max_replicas", self.min_replicas)
        if self.min_replicas < 1 or self.max_replicas < self.min_replicas:
            raise InvalidParameterError("need 1 <= --min-replicas <= --max-replicas",
                                        "min_replicas")
        if self.target_tokens_per_replica <= 0:
            raise InvalidParameterError("--target-tokens-per-replica must be positive",
                                        "target_tokens_per_replica")
        if self.replica_num_cpus is None:
            object.__setattr__(self, "replica_num_cpus",
                               max(1, (os.cpu_count() or 1) // self.max_replicas))
        if self.replica_num_cpus <= 0:
            raise InvalidParameterError("--replica-num-cpus must be positive",
                                        "replica_num_cpus")
