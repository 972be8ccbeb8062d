"""``tokenmill serve --ray``: the engine and app of ``tokenmill serve`` in N Ray Serve replicas.

Starts a local Ray instance on the loopback interface (dashboard off), or joins one with
``--ray-address``; runs Serve's HTTP proxy on ``--host:--port``; deploys
``TokenmillReplica`` with the token-load autoscaling policy and request router; serves
until SIGINT/SIGTERM, then removes what it started (the whole local Ray instance, or
only its application on a cluster it joined).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from tokenmill.config import EngineConfig
from tokenmill.ray_serve.policy import TokenLoadPolicy

logger = logging.getLogger("tokenmill")

APP_NAME = "tokenmill"
DEPLOYMENT_NAME = "tokenmill"
SERVER_ARGS = ("served_model_name", "metrics_vllm_names", "disable_log_stats",
               "log_stats_interval", "default_continuous_usage_stats", "api_key",
               "shutdown_timeout", "ui_show_text", "max_request_body_size")
DEFAULT_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"


def add_ray_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray Serve (pip install 'tokenmill[ray]')")
    group.add_argument("--ray", action="store_true",
                       help="serve from Ray Serve replicas instead of one process")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster ('auto': the local one) instead of "
                            "starting one on 127.0.0.1")
    group.add_argument("--min-replicas", type=int, default=1)
    group.add_argument("--max-replicas", type=int, default=None,
                       help="default: --min-replicas (no autoscaling)")
    group.add_argument("--target-tokens-per-replica", type=float, default=24576,
                       help="autoscale to ceil(sum of KV tokens used + tokens waiting / this)")
    group.add_argument("--upscale-delay-s", type=float, default=30.0)
    group.add_argument("--downscale-delay-s", type=float, default=300.0)
    group.add_argument("--look-back-period-s", type=float, default=10.0,
                       help="the autoscaler averages each replica's token load over this")
    group.add_argument("--autoscaling-metrics-interval-s", type=float, default=1.0,
                       help="how often replicas report their token load to the autoscaler")
    group.add_argument("--routing-stats-period-s", type=float, default=0.1,
                       help="how often replicas report their token load to the router")
    group.add_argument("--replica-num-cpus", type=float, default=None,
                       help="CPUs (and torch threads) per replica; default: this host's "
                            "cores / --max-replicas")
    group.add_argument("--request-router", choices=("default", "token-load"),
                       default="default",
                       help="Serve's default (power of two choices on requests in flight), "
                            "or least token load")
    group.add_argument("--ray-metrics-export-port", type=int, default=None,
                       help="where the local Ray instance exports its Prometheus metrics, "
                            "per-replica tokenmill gauges included")


def validate_ray_options(args: argparse.Namespace) -> None:
    if args.max_replicas is None:
        args.max_replicas = args.min_replicas
    if args.min_replicas < 1 or args.max_replicas < args.min_replicas:
        raise ValueError("need 1 <= --min-replicas <= --max-replicas")
    if args.target_tokens_per_replica <= 0:
        raise ValueError("--target-tokens-per-replica must be positive")
    if args.replica_num_cpus is None:
        args.replica_num_cpus = max(1, (os.cpu_count() or 1) // args.max_replicas)
    if args.replica_num_cpus <= 0:
        raise ValueError("--replica-num-cpus must be positive")


def deployment_options(args: argparse.Namespace, config: EngineConfig) -> dict:
    """Serve deployment options: replicas or autoscaling, router, CPUs, concurrency.

    ``max_ongoing_requests`` is what the engine takes at once (``max_num_seqs``) plus its
    queue cap: beyond that the proxy keeps requests, and a new replica gets them.
    """
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    from tokenmill.ray_serve.router import TokenLoadRequestRouter

    router = TokenLoadRequestRouter if args.request_router == "token-load" else DEFAULT_ROUTER
    options = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": config.max_num_seqs + (config.max_num_queued_requests or 0),
        "ray_actor_options": {"num_cpus": args.replica_num_cpus},
        "request_router_config": RequestRouterConfig(
            request_router_class=router,
            request_routing_stats_period_s=args.routing_stats_period_s),
    }
    if args.min_replicas == args.max_replicas:
        options["num_replicas"] = args.min_replicas
    else:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=args.min_replicas, max_replicas=args.max_replicas,
            initial_replicas=args.min_replicas,
            metrics_interval_s=args.autoscaling_metrics_interval_s,
            look_back_period_s=args.look_back_period_s,
            upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s,
            policy=AutoscalingPolicy(
                policy_function=TokenLoadPolicy,
                policy_kwargs={"target_tokens_per_replica": args.target_tokens_per_replica}))
    return options


def build_application(args: argparse.Namespace, config: EngineConfig):
    """The Serve application of ``tokenmill serve --ray`` (for ``serve.run``)."""
    from tokenmill.cli import LIMIT_OPTIONS, api_keys_from
    from tokenmill.ray_serve.replica import TokenmillReplica

    validate_ray_options(args)
    server_args = {name: getattr(args, name) for name in (*SERVER_ARGS, *LIMIT_OPTIONS)}
    server_args["api_key"] = list(api_keys_from(args))  # $TOKENMILL_API_KEY read here
    from ray import serve

    deployment = serve.deployment(TokenmillReplica, **deployment_options(args, config))
    return deployment.bind(server_args, config)


def start_local_ray(num_cpus: int | None = None, metrics_export_port: int | None = None) -> None:
    """A single-node Ray instance on 127.0.0.1, dashboard off."""
    # Before Ray is imported: a single-node instance uses the loopback address.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    options = {"_metrics_export_port": metrics_export_port} if metrics_export_port else {}
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, **options)


def serve_on_ray(args: argparse.Namespace, config: EngineConfig) -> int:
    validate_ray_options(args)
    own_ray = args.ray_address is None
    if own_ray:
        start_local_ray(metrics_export_port=args.ray_metrics_export_port)
    import ray
    from ray import serve

    if not own_ray:
        ray.init(address=args.ray_address)
    logger.info("Ray cluster at %s", ray.get_runtime_context().gcs_address)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(args, config), name=APP_NAME, route_prefix="/")
        logger.info("serving on http://%s:%d with %d-%d Ray Serve replicas", args.host,
                    args.port, args.min_replicas, args.max_replicas)
        stop.wait()
    finally:
        if own_ray:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP_NAME)
    return 0
