"""``TokenmillReplica``: a Ray Serve replica = one engine + the app of ``tokenmill serve``.

The constructor builds the engine on a thread of its own, which then runs the step loop
(PyTorch keeps one OpenMP pool per thread: the thread that loaded the model steps it,
as in a single server). The replica's event loop serves the app; its lifespan attaches
the engine to that loop and shuts it down. Torch gets as many threads as the replica
has CPUs (``num_cpus``), so replicas on one host share its cores instead of each taking
them all.

Besides the app, a replica reports ``TokenLoad.stats()`` to Serve's autoscaler
(``record_autoscaling_stats``) and router (``record_routing_stats``), and mirrors the
scheduler gauges as Ray metrics labelled by replica (``ReplicaGauges``). Every response
names its replica in the ``x-tokenmill-replica`` header.
"""

from __future__ import annotations

import argparse
import threading

import ray
import torch
from ray import serve
from ray.serve import metrics as serve_metrics

from tokenmill.config import EngineConfig
from tokenmill.frontend.builder import build_engine
from tokenmill.metrics.prometheus import METRICS
from tokenmill.metrics.records import IterationStats, SchedulerStats
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
    def __init__(self, server_args: dict, config: EngineConfig) -> None:
        self._args = argparse.Namespace(**server_args)
        self._config = config
        self._load = TokenLoad()
        self._num_threads = max(1, int(ray.get_runtime_context().get_assigned_resources()
                                       .get("CPU", 1)))
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run_engine, name="tokenmill-engine",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run_engine(self) -> None:
        try:
            torch.set_num_threads(self._num_threads)
            engine = build_engine(self._config)
            gauges = ReplicaGauges(self._args.served_model_name or engine.model_name)
            self._engine, self._app = build_server(self._args, engine, [self._load, gauges])
        except BaseException as error:  # noqa: BLE001 - re-raised by the constructor
            self._error = error
            return
        finally:
            self._ready.set()
        self._engine.run()

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
