"""The resident memory of the server's processes, read from ``/proc`` when ``/metrics`` is
scraped: ``tokenmill_process_resident_memory_bytes{process="http"|"engine"}``.

The engine's value is its own process's, read by pid from the HTTP process, so nothing
crosses the engine pipe and nothing runs on the engine's step. A process whose
``/proc/<pid>/statm`` cannot be read (it exited; a system without ``/proc``) has no sample.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.resident_memory import resident_bytes

NAME = "tokenmill_process_resident_memory_bytes"
DOC = "Resident memory (RSS) of the server's processes, by process: http or engine."


class ProcessMemoryCollector(Collector):
    """One gauge sample per process in ``pids`` (label value -> pid), read at each scrape."""

    def __init__(self, model_name: str, pids: dict[str, int]) -> None:
        self.model_name = model_name
        self.pids = pids

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(NAME, DOC, labels=["model_name", "process"])
        for process, pid in self.pids.items():
            rss = resident_bytes(pid)
            if rss is not None:
                family.add_metric([self.model_name, process], rss)
        yield family
