"""``TokenmillReplica``: a Ray Serve replica = one engine + the app of ``tokenmill serve``.

The constructor starts the replica's engine process (``engine.process``, as a single server
does) and a thread that hands the engine's results to the replica's event loop; the
app's lifespan attaches the engine client to that loop and shuts the engine down. The
engine gets as many compute threads as the replica has CPUs (``num_cpus``), so replicas
on one host share its cores instead of each taking them all.

Besides the app, a replica reports ``TokenLoad.stats()`` to Serve's autoscaler
(``record_autoscaling_stats``) and router (``record_routing_stats``), and mirrors the
scheduler gauges as Ray metrics labelled by replica (``ReplicaGauges``). Every response
names its replica in the ``x-tokenmill-replica`` header.
"""

from __future__ import annotations

import dataclasses
import threading

import ray
from ray import serve
from ray.serve import metrics as serve_metrics

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.core.records import IterationStats, SchedulerStats
from tokenmill.engine.process import ProcessClient
from tokenmill.metrics.prometheus import METRICS
from tokenmill.ray_serve.load import TokenLoad
from tokenmill.server.app import build_server

REPLICA_HEADER = "x-tokenmill-replica"
# Ray exports these as ray_<name>{deployment, replica, application, model_name}.
_GAUGE_FIELDS = {
    "running": "num_running", "waiting": "num_waiting", "kv_usage": "kv_cache_usage",
    "kv_tokens": "kv_cache_tokens_used", "tokens_waiting": "num_tokens_waiting",
    "tokens_waiting_raw": "num_tokens_waiting_raw",
}


class ReplicaGauges:
    """Step sink: the scheduler gauges of ``/metrics``, as Ray metrics tagged by replica."""

    def __init__(self, model_name: str) -> None:
        specs = {spec.key: spec for spec in METRICS}
        self._gauges = []
        for key, field in _GAUGE_FIELDS.items():
            gauge = serve_metrics.Gauge(specs[key].name, specs[key].doc, tag_keys=("model_name",))
            gauge.set_default_tags({"model_name": model_name})
            self._gauges.append((gauge, field))

    def record_step(self, scheduler: SchedulerStats, iteration: IterationStats | None) -> None:
        for gauge, field in self._gauges:
            gauge.set(getattr(scheduler, field))


@serve.ingress()
class TokenmillReplica:
    def __init__(self, server_config: ServerConfig, config: EngineConfig) -> None:
        num_threads = max(1, int(ray.get_runtime_context().get_assigned_resources()
                                 .get("CPU", 1)))
        config = dataclasses.replace(config, num_threads=num_threads)
        self._load = TokenLoad()
        client = ProcessClient.start(config)
        self._process = client.process
        gauges = ReplicaGauges(server_config.served_model_name or client.info.model_name)
        self._engine, self._app, _ = build_server(server_config, config, client,
                                                  [self._load, gauges])
        self._thread = threading.Thread(target=self._engine.run, name="tokenmill-results",
                                        daemon=True)
        self._thread.start()

    def __serve_build_asgi_app__(self):
        """The app, with each response naming its replica in ``x-tokenmill-replica``."""
        replica = serve.get_replica_context().replica_id.unique_id

        @self._app.middleware("http")
        async def name_replica(request, call_next):
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = replica
            return response

        return self._app

    def record_autoscaling_stats(self) -> dict[str, int]:
        return self._load.stats()

    def record_routing_stats(self) -> dict[str, int]:
        return self._load.stats()

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:  # the app's lifespan has normally done this already
            engine.shutdown()
            self._thread.join(timeout=10)
            self._process.join(timeout=10)
