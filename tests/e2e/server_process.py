"""Start ``tokenmill serve`` as a real subprocess on a free loopback port, for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str | None, *args: str, startup_timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "tokenmill.cli", "serve"]
        if model is not None:
            command.append(model)
        command += ["--port", str(self.port), "--dtype", "float32", *args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tokenmill-{self.port}.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        log = self.log()
        self.stop()
        raise RuntimeError(f"server did not start in {timeout}s:\n{log}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as ``name{label=value,...}`` -> value (model_name dropped)."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "model_name")
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def wait_idle(self, timeout: float = 120.0) -> dict[str, float]:
        """Poll until nothing runs or waits and no KV block is held; return the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["tokenmill_num_requests_running"] == m["tokenmill_num_requests_waiting"]
                    == m["tokenmill_kv_cache_tokens_used"] == 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {m}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
