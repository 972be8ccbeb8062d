"""``tokenmill serve --ray`` end to end: one local Ray instance for the module, started by
the CLI on the loopback interface; this test process joins it as a driver to read Serve's
state and each replica's token load, and to redeploy the application with autoscaling.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_process import ServerProcess

from tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.ray
serve_api = pytest.importorskip("ray.serve")

MAX_MODEL_LEN = 4096
MARKER = "TOKENMILL_RAY_TEST_RUN"
APP = "tokenmill"
REPLICA_HEADER = "x-tokenmill-replica"


def _processes_marked(value: str) -> list[int]:
    """Pids (not this one) whose environment carries ``MARKER=value``: Ray's processes."""
    needle = f"{MARKER}={value}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def tiny_long_model(tmp_path_factory) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-4k"),
                               max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def ray_server(tiny_long_model):
    """Two fixed replicas (1 CPU each) behind Serve's proxy; Ray fully gone afterwards."""
    run_id = uuid.uuid4().hex
    os.environ[MARKER] = run_id
    try:
        server = ServerProcess(tiny_long_model, "--ray", "--min-replicas", "2",
                               "--replica-num-cpus", "1", "--served-model-name", "tiny",
                               "--max-model-len", str(MAX_MODEL_LEN),
                               "--request-router", "token-load", "--routing-stats-period-s", "0.2",
                               startup_timeout=240)
    finally:
        del os.environ[MARKER]
    import ray

    try:
        with open(server.log_path) as log:
            address = re.search(r"Ray cluster at (\S+)", log.read()).group(1)
        ray.init(address=address, logging_level="warning")
        deadline = time.monotonic() + 120  # /health answers as soon as one replica does
        while _running_replicas() < 2:
            assert time.monotonic() < deadline, "the second replica did not start"
            time.sleep(0.2)
        yield server
    finally:
        ray.shutdown()
        server.process.terminate()
        server.process.wait(timeout=120)
        server._log.close()
        deadline = time.monotonic() + 30
        while _processes_marked(run_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _processes_marked(run_id) == [], "Ray processes left running"


@pytest.fixture(scope="module")
def single_server(tiny_long_model):
    server = ServerProcess(tiny_long_model, "--served-model-name", "tiny",
                           "--max-model-len", str(MAX_MODEL_LEN))
    yield server
    server.stop()


def _running_replicas() -> int:
    return _replica_states().get("RUNNING", 0)


def _replica_states() -> dict[str, int]:
    """Replicas of the app by state (STARTING, RUNNING, STOPPING, ...)."""
    status = serve_api.status().applications.get(APP)
    return {} if status is None else dict(status.deployments[APP].replica_states)


def _replica_load(replica: str) -> dict:
    import ray

    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#{APP}#{replica}", namespace="serve")
    return ray.get(actor.record_routing_stats.remote(), timeout=10)


def _complete(base_url: str, prompt: str, max_tokens: int, **extra) -> tuple[str, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **extra}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.headers.get(REPLICA_HEADER), response.json()  # None: a single server


def _stream_events(base_url: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                events.append({"text": [c["text"] for c in event["choices"]],
                               "finish": [c["finish_reason"] for c in event["choices"]],
                               "usage": event["usage"]})
    return events


def test_both_replicas_serve(ray_server):
    assert _running_replicas() == 2
    seen = set()
    deadline = time.monotonic() + 30
    while len(seen) < 2 and time.monotonic() < deadline:
        seen.add(_complete(ray_server.base_url, "Hello, world!", 4)[0])
    assert len(seen) == 2
    assert httpx.get(ray_server.base_url + "/v1/models").json()["data"][0]["id"] == "tiny"


def _assert_same_choices(ours: list[dict], theirs: list[dict]) -> None:
    """Equal choices; logprobs up to float32 rounding, whose last bits follow the batch."""
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs, strict=True):
        mine, other = dict(mine), dict(other)
        my_logprobs, other_logprobs = mine.pop("logprobs"), other.pop("logprobs")
        assert mine == other
        for key in ("tokens", "text_offset"):
            assert my_logprobs[key] == other_logprobs[key]
        assert my_logprobs["token_logprobs"] == pytest.approx(other_logprobs["token_logprobs"],
                                                              abs=1e-5)
        for my_top, other_top in zip(my_logprobs["top_logprobs"],
                                     other_logprobs["top_logprobs"], strict=True):
            assert my_top == pytest.approx(other_top, abs=1e-5)


def test_greedy_text_and_usage_equal_the_single_server(ray_server, single_server):
    prompts = ["The quick brown fox", "Tell me a story about a robot who learns to paint.",
               "Numbers such as 1, 2, 3"]
    for prompt in prompts:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}
        assert _stream_events(ray_server.base_url, body) == _stream_events(
            single_server.base_url, body)
        # A new first block: no prefix-cache hit on the server that streamed the prompt
        # above, which would count cached tokens where a replica that did not cannot.
        other_prompt = "Again: " + prompt
        ray_reply = _complete(ray_server.base_url, other_prompt, 16, n=2, logprobs=2)[1]
        single_reply = _complete(single_server.base_url, other_prompt, 16, n=2, logprobs=2)[1]
        assert ray_reply["usage"] == single_reply["usage"]
        _assert_same_choices(ray_reply["choices"], single_reply["choices"])
    bad = httpx.post(ray_server.base_url + "/v1/completions",
                     json={"model": "tiny", "prompt": "x", "max_tokens": MAX_MODEL_LEN + 1})
    assert bad.status_code == 400
    assert bad.json() == httpx.post(single_server.base_url + "/v1/completions",
                                    json={"model": "tiny", "prompt": "x",
                                          "max_tokens": MAX_MODEL_LEN + 1}).json()


def test_client_disconnect_aborts_on_the_replica_and_frees_its_kv(ray_server):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": MAX_MODEL_LEN - 16,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", ray_server.base_url + "/v1/completions", json=body,
                      timeout=60) as response:
        response.raise_for_status()
        replica = response.headers[REPLICA_HEADER]
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert _replica_load(replica)["kv_cache_tokens_used"] > 0
    left = time.monotonic()
    while _replica_load(replica)["kv_cache_tokens_used"] > 0:
        assert time.monotonic() - left < 1.0, "KV cache not freed within 1 s of the disconnect"
        time.sleep(0.02)


def test_small_requests_avoid_the_replica_holding_a_long_prompt(ray_server):
    long_prompt = " ".join(["The weather was warm and the sky was blue."] * 30)
    body = {"model": "tiny", "prompt": long_prompt, "max_tokens": 2048,  # prompt: 630 tokens
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", ray_server.base_url + "/v1/completions", json=body,
                      timeout=60) as response:
        response.raise_for_status()
        busy = response.headers[REPLICA_HEADER]
        lines = response.iter_lines()
        next(lines)
        time.sleep(0.6)  # three routing-stats periods: the router sees the long request
        assert _replica_load(busy)["token_load"] > 300
        # All at once: Serve's default router would balance them by queue length.
        with ThreadPoolExecutor(8) as pool:
            served_by = list(pool.map(lambda _: _complete(ray_server.base_url, "Hello!", 2)[0],
                                      range(8)))
    assert sum(r != busy for r in served_by) >= 7, served_by


def test_token_load_scales_one_to_two_and_back(ray_server, tiny_long_model):
    from tokenmill.config import EngineConfig, ServerConfig
    from tokenmill.ray_serve.launch import build_application
    from tokenmill.ray_serve.options import RayConfig

    ray_config = RayConfig(
        ray=True, min_replicas=1, max_replicas=2, target_tokens_per_replica=256,
        upscale_delay_s=1, downscale_delay_s=5, look_back_period_s=1,
        autoscaling_metrics_interval_s=0.25, routing_stats_period_s=0.2, replica_num_cpus=1,
        request_router="token-load")
    config = EngineConfig(model=tiny_long_model, dtype="float32", max_model_len=MAX_MODEL_LEN)
    serve_api.delete(APP)
    serve_api.run(build_application(ray_config, ServerConfig(served_model_name="tiny"), config),
                  name=APP, route_prefix="/")
    assert _running_replicas() == 1

    stop = threading.Event()

    def keep_busy() -> None:  # one long stream after another, each holding > 256 KV tokens
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2000,
                "ignore_eos": True, "stream": True}
        while not stop.is_set():
            with httpx.stream("POST", ray_server.base_url + "/v1/completions", json=body,
                              timeout=60) as response:
                response.raise_for_status()
                for _ in response.iter_lines():
                    if stop.is_set():
                        break

    workers = [threading.Thread(target=keep_busy) for _ in range(2)]
    started = time.monotonic()
    for worker in workers:
        worker.start()
    try:  # the autoscaler adds a replica within 15 s; starting it takes what a model takes
        while sum(_replica_states().values()) < 2:
            assert time.monotonic() - started < 15, "no second replica within 15 s"
            time.sleep(0.25)
        while _running_replicas() < 2:
            assert time.monotonic() - started < 90, "the second replica did not start"
            time.sleep(0.25)
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    idle = time.monotonic()
    while _running_replicas() > 1:
        assert time.monotonic() - idle < ray_config.downscale_delay_s + 10, \
            "did not scale back down"
        time.sleep(0.25)
