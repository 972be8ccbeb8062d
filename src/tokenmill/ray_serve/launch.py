"""``tokenmill serve --ray``: the engine and app of ``tokenmill serve`` in N Ray Serve replicas.

Starts a local Ray instance on the loopback interface (dashboard off), or joins one with
``--ray-address``; runs Serve's HTTP proxy on ``--host:--port``; deploys
``TokenmillReplica`` with the token-load autoscaling policy and request router; serves
until SIGINT/SIGTERM, then removes what it started (the whole local Ray instance, or
only its application on a cluster it joined).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.ray_serve.options import RayConfig
from tokenmill.ray_serve.policy import TokenLoadPolicy

logger = logging.getLogger("tokenmill")

APP_NAME = "tokenmill"
DEPLOYMENT_NAME = "tokenmill"
DEFAULT_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"


def deployment_options(ray_config: RayConfig, config: EngineConfig) -> dict:
    """Serve deployment options: replicas or autoscaling, router, CPUs, concurrency.

    ``max_ongoing_requests`` is what the engine takes at once (``max_num_seqs``) plus its
    queue cap: beyond that the proxy keeps requests, and a new replica gets them.
    """
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    from tokenmill.ray_serve.router import TokenLoadRequestRouter

    router = TokenLoadRequestRouter if ray_config.request_router == "token-load" else DEFAULT_ROUTER
    options = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": config.max_num_seqs + (config.max_num_queued_requests or 0),
        "ray_actor_options": {"num_cpus": ray_config.replica_num_cpus},
        "request_router_config": RequestRouterConfig(
            request_router_class=router,
            request_routing_stats_period_s=ray_config.routing_stats_period_s),
    }
    if ray_config.min_replicas == ray_config.max_replicas:
        options["num_replicas"] = ray_config.min_replicas
    else:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=ray_config.min_replicas, max_replicas=ray_config.max_replicas,
            initial_replicas=ray_config.min_replicas,
            metrics_interval_s=ray_config.autoscaling_metrics_interval_s,
            look_back_period_s=ray_config.look_back_period_s,
            upscale_delay_s=ray_config.upscale_delay_s,
            downscale_delay_s=ray_config.downscale_delay_s,
            policy=AutoscalingPolicy(
                policy_function=TokenLoadPolicy,
                policy_kwargs={
                    "target_tokens_per_replica": ray_config.target_tokens_per_replica}))
    return options


def build_application(ray_config: RayConfig, server_config: ServerConfig,
                      config: EngineConfig):
    """The Serve application of ``tokenmill serve --ray`` (for ``serve.run``): every replica
    receives the two settings records as they are."""
    from ray import serve

    from tokenmill.ray_serve.replica import TokenmillReplica

    deployment = serve.deployment(TokenmillReplica, **deployment_options(ray_config, config))
    return deployment.bind(server_config, config)


def start_local_ray(num_cpus: int | None = None, metrics_export_port: int | None = None) -> None:
    """A single-node Ray instance on 127.0.0.1, dashboard off."""
    # Before Ray is imported: a single-node instance uses the loopback address.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    options = {"_metrics_export_port": metrics_export_port} if metrics_export_port else {}
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, **options)


def serve_on_ray(ray_config: RayConfig, server_config: ServerConfig,
                 config: EngineConfig) -> int:
    own_ray = ray_config.ray_address is None
    if own_ray:
        start_local_ray(metrics_export_port=ray_config.ray_metrics_export_port)
    import ray
    from ray import serve

    if not own_ray:
        ray.init(address=ray_config.ray_address)
    logger.info("Ray cluster at %s", ray.get_runtime_context().gcs_address)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        serve.run(build_application(ray_config, server_config, config), name=APP_NAME,
                  route_prefix="/")
        logger.info("serving on http://%s:%d with %d-%d Ray Serve replicas",
                    server_config.host, server_config.port, ray_config.min_replicas,
                    ray_config.max_replicas)
        stop.wait()
    finally:
        if own_ray:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP_NAME)
    return 0
