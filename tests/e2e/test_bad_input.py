"""Bad input gets a 400 (or 404) with an OpenAI error body naming the parameter, and
never hurts anyone else: the server keeps serving and holds no KV block afterwards."""

from __future__ import annotations

import httpx
import pytest

BAD_COMPLETIONS = [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": [1, 2, -3]}, "prompt"),
    ({"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": "hi", "stop": 7}, "stop"),
    ({"prompt": "hi", "presence_penalty": 5}, "presence_penalty"),
    ({"max_tokens": 3}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_values_get_400_naming_the_parameter(tiny_server, body, param) -> None:
    r = httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]


def test_bad_chat_values(tiny_server) -> None:
    url = tiny_server.base_url + "/v1/chat/completions"
    cases = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
         "max_tokens"),
    ]
    for body, param in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())


def test_malformed_json_and_unknown_model(tiny_server) -> None:
    r = httpx.post(tiny_server.base_url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(tiny_server.base_url + "/v1/completions",
                   json={"model": "no-such-model", "prompt": "hi"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"


def test_server_keeps_serving_and_leaks_no_block_after_bad_input(tiny_server, client) -> None:
    for body, _ in BAD_COMPLETIONS:
        httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=30)
    result = client.completions.create(model="tiny", prompt="still alive", max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 3
    tiny_server.wait_idle()


def test_request_id_header_is_echoed(tiny_server) -> None:
    r = httpx.post(tiny_server.base_url + "/v1/completions",
                   json={"prompt": "hi", "max_tokens": 1}, headers={"x-request-id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "cmpl-abc-123"
    again = httpx.post(tiny_server.base_url + "/v1/completions",  # ids may repeat
                       json={"prompt": "hi", "max_tokens": 1}, headers={"x-request-id": "abc-123"})
    assert again.status_code == 200
    assert "request abc-123:" in tiny_server.log()


def test_tokenize_detokenize_and_info_endpoints(tiny_server) -> None:
    base = tiny_server.base_url
    tokens = httpx.post(base + "/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(base + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "hello world"
    assert httpx.post(base + "/detokenize", json={"tokens": [10**6]}).status_code == 400
    models = httpx.get(base + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    assert httpx.get(base + "/version").json()["version"]
    assert httpx.get(base + "/health").status_code == 200
