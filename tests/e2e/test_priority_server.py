"""Request priority through the server and the openai client: honoured with
``--scheduling-policy priority`` (lower first), a 400 otherwise, and carried on the
lifecycle record and the request's metrics."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI
from server_process import ServerProcess


@pytest.fixture(scope="module")
def priority_server(tiny_model):
    server = ServerProcess(tiny_model, "--served-model-name", "tiny", "--max-model-len", "256",
                           "--scheduling-policy", "priority", "--max-num-seqs", "1")
    yield server
    server.stop()


def recent(server) -> list[dict]:
    return httpx.get(server.base_url + "/v1/requests/recent").json()["data"]


def test_lower_priority_values_run_first(priority_server) -> None:
    client = OpenAI(base_url=priority_server.base_url + "/v1", api_key="unused", max_retries=0)
    preemptions: dict[int, int] = {}

    def send(priority: int, max_tokens: int) -> None:
        result = client.completions.create(
            model="tiny", prompt=f"request {priority}", max_tokens=max_tokens, temperature=0.0,
            extra_body={"priority": priority, "ignore_eos": True, "include_metrics": True})
        metrics = result.model_extra["metrics"][0]
        assert metrics["priority"] == priority
        preemptions[priority] = metrics["num_preemptions"]

    blocker = threading.Thread(target=send, args=(0, 240))
    blocker.start()
    while not any(r["status"] == "decoding" for r in recent(priority_server)):
        time.sleep(0.01)  # the one seat is taken: the rest wait in the queue
    threads = [threading.Thread(target=send, args=(p, 4)) for p in (5, 3, -1, 4)]
    for t in threads:
        t.start()
    for t in [blocker, *threads]:
        t.join(timeout=120)
    # -1 outranks the running 0 and takes its seat; 0 then resumes before the others (the
    # order the server finished them in: the clients' threads may see their answers later)
    finished = sorted(recent(priority_server), key=lambda r: r["end_time"])
    assert [r["priority"] for r in finished] == [-1, 0, 3, 4, 5]
    assert preemptions == {-1: 0, 0: 1, 3: 0, 4: 0, 5: 0}
    assert priority_server.wait_idle()["tokenmill_num_tokens_waiting"] == 0


def test_priority_needs_the_priority_policy(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=1,
                                  extra_body={"priority": 1})
    assert e.value.body["param"] == "priority"
    ok = client.completions.create(model="tiny", prompt="hi", max_tokens=1,
                                   extra_body={"priority": 0})
    assert ok.usage.completion_tokens == 1
