"""The process memory gauge: each process's RSS as /proc reports it, read at scrape time,
and no sample for a process that has gone."""

from __future__ import annotations

import os
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.metrics.prometheus import PrometheusMetrics

GROW = ("import sys, time; block = b'x' * (64 << 20); sys.stdout.write('ready\\n'); "
        "sys.stdout.flush(); time.sleep(60)")


def memory_samples(metrics: PrometheusMetrics) -> dict[str, float]:
    body = metrics.render()[0].decode()
    return {s.labels["process"]: s.value for f in text_string_to_metric_families(body)
            for s in f.samples if s.name == "tokenmill_process_resident_memory_bytes"}


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_both_processes_report_their_own_resident_memory() -> None:
    child = subprocess.Popen([sys.executable, "-c", GROW], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        metrics = PrometheusMetrics("m", engine_pid=child.pid)
        samples = memory_samples(metrics)
        assert set(samples) == {"http", "engine"}
        assert samples["engine"] >= 64 << 20  # the block it wrote is resident
        assert abs(samples["engine"] - vm_rss(child.pid)) < 1 << 20
        assert abs(samples["http"] - vm_rss(os.getpid())) < 8 << 20
    finally:
        child.kill()
        child.wait()
    assert set(memory_samples(metrics)) == {"http"}  # the engine has gone: no sample


def test_without_an_engine_pid_only_this_process_is_reported() -> None:
    samples = memory_samples(PrometheusMetrics("m"))
    assert set(samples) == {"http"} and samples["http"] > 0
