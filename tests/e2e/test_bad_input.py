"""Bad input gets a 4xx with an OpenAI error body (``message``, ``type``, ``param``,
``code``) naming the field, and never hurts anyone else: the server keeps serving and
holds no KV block afterwards. One table drives every endpoint."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
USER = [{"role": "user", "content": "hi"}]


def completion(**fields) -> dict:
    return {"prompt": "hi", **fields}


def chat(**fields) -> dict:
    return {"messages": USER, **fields}


# (method, path, JSON body or raw bytes, expected status, expected error.param)
BAD_REQUESTS = [
    # completions: prompt
    ("POST", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": 42}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": [[]]}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": ["a", ""]}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": [1, 2, -3]}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": [True, 2]}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": [1.5]}, 400, "prompt"),
    ("POST", COMPLETIONS, {"prompt": ["a"] * 257}, 400, "prompt"),
    ("POST", COMPLETIONS, rb'{"prompt": "x\ud800y"}', 400, "prompt"),  # a lone surrogate
    ("POST", CHAT, rb'{"messages": [{"role": "user", "content": "\udc00"}]}', 400, "messages"),
    # completions: numbers
    ("POST", COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    ("POST", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("POST", COMPLETIONS, completion(max_tokens="many"), 400, "max_tokens"),
    ("POST", COMPLETIONS, completion(max_tokens=1.5), 400, "max_tokens"),
    ("POST", COMPLETIONS, completion(max_tokens=100000), 400, "max_tokens"),
    ("POST", COMPLETIONS, completion(temperature=-0.5), 400, "temperature"),
    ("POST", COMPLETIONS, completion(temperature="hot"), 400, "temperature"),
    ("POST", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("POST", COMPLETIONS, b'{"prompt": "hi", "temperature": 1e999}', 400, "temperature"),
    ("POST", COMPLETIONS, completion(top_p=0), 400, "top_p"),
    ("POST", COMPLETIONS, completion(top_p=1.5), 400, "top_p"),
    ("POST", COMPLETIONS, completion(top_k=-5), 400, "top_k"),
    ("POST", COMPLETIONS, completion(top_k=2.5), 400, "top_k"),
    ("POST", COMPLETIONS, completion(min_p=1.5), 400, "min_p"),
    ("POST", COMPLETIONS, completion(n=0), 400, "n"),
    ("POST", COMPLETIONS, completion(n=129), 400, "n"),
    ("POST", COMPLETIONS, completion(n="2"), 400, "n"),
    ("POST", COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    ("POST", COMPLETIONS, completion(logprobs=-1), 400, "logprobs"),
    ("POST", COMPLETIONS, completion(logprobs=True), 400, "logprobs"),
    ("POST", COMPLETIONS, completion(presence_penalty=5), 400, "presence_penalty"),
    ("POST", COMPLETIONS, completion(frequency_penalty=-3), 400, "frequency_penalty"),
    ("POST", COMPLETIONS, completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("POST", COMPLETIONS, completion(seed="x"), 400, "seed"),
    ("POST", COMPLETIONS, completion(seed=2**64), 400, "seed"),
    ("POST", COMPLETIONS, completion(min_tokens=-1), 400, "min_tokens"),
    ("POST", COMPLETIONS, completion(min_tokens=20, max_tokens=5), 400, "min_tokens"),
    # completions: stop
    ("POST", COMPLETIONS, completion(stop=7), 400, "stop"),
    ("POST", COMPLETIONS, completion(stop=[""]), 400, "stop"),
    ("POST", COMPLETIONS, completion(stop=[1]), 400, "stop"),
    ("POST", COMPLETIONS, completion(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("POST", COMPLETIONS, completion(stop="x" * 257), 400, "stop"),
    ("POST", COMPLETIONS, completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("POST", COMPLETIONS, completion(stop_token_ids=[99999]), 400, "stop_token_ids"),
    ("POST", COMPLETIONS, completion(stop_token_ids="2"), 400, "stop_token_ids"),
    ("POST", COMPLETIONS, completion(stop_token_ids=list(range(17))), 400, "stop_token_ids"),
    # completions: flags, model, unsupported fields
    ("POST", COMPLETIONS, completion(stream="yes"), 400, "stream"),
    ("POST", COMPLETIONS, completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("POST", COMPLETIONS, completion(stream=True, stream_options="all"), 400, "stream_options"),
    ("POST", COMPLETIONS, completion(stream=True, stream_options={"include_usage": "yes"}),
     400, "stream_options"),
    ("POST", COMPLETIONS, completion(echo=1), 400, "echo"),
    ("POST", COMPLETIONS, completion(ignore_eos="true"), 400, "ignore_eos"),
    ("POST", COMPLETIONS, completion(user=5), 400, "user"),
    ("POST", COMPLETIONS, completion(model=5), 400, "model"),
    ("POST", COMPLETIONS, completion(model="no-such-model"), 404, "model"),
    ("POST", COMPLETIONS, completion(suffix="!"), 400, "suffix"),
    ("POST", COMPLETIONS, completion(logit_bias={"1": 101}), 400, "logit_bias"),
    ("POST", COMPLETIONS, completion(logit_bias={"1": -100.5}), 400, "logit_bias"),
    ("POST", COMPLETIONS, completion(logit_bias={"one": 5}), 400, "logit_bias"),
    ("POST", COMPLETIONS, completion(logit_bias={"-1": 5}), 400, "logit_bias"),
    ("POST", COMPLETIONS, completion(logit_bias={"99999": 5}), 400, "logit_bias"),
    ("POST", COMPLETIONS, completion(logit_bias={"1": "5"}), 400, "logit_bias"),
    ("POST", COMPLETIONS, completion(logit_bias=[1]), 400, "logit_bias"),
    ("POST", COMPLETIONS, completion(best_of=3), 400, "best_of"),
    # embeddings
    ("POST", EMBEDDINGS, {"input": ""}, 400, "input"),
    ("POST", EMBEDDINGS, {"input": []}, 400, "input"),
    ("POST", EMBEDDINGS, {"input": [[]]}, 400, "input"),
    ("POST", EMBEDDINGS, {"input": ["ok", ""]}, 400, "input"),
    ("POST", EMBEDDINGS, {"input": [99999]}, 400, "input"),
    ("POST", EMBEDDINGS, {"input": 5}, 400, "input"),
    ("POST", EMBEDDINGS, {"input": "x " * 300}, 400, "input"),
    ("POST", EMBEDDINGS, {"input": "x", "dimensions": 8}, 400, "dimensions"),
    ("POST", EMBEDDINGS, {"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ("POST", EMBEDDINGS, {"input": "x", "normalize": "yes"}, 400, "normalize"),
    ("POST", EMBEDDINGS, {"input": "x", "priority": 2}, 400, "priority"),
    ("POST", EMBEDDINGS, {"input": "x", "model": "other"}, 404, "model"),
    # chat
    ("POST", CHAT, {"messages": []}, 400, "messages"),
    ("POST", CHAT, {"messages": "hi"}, 400, "messages"),
    ("POST", CHAT, {"messages": ["hi"]}, 400, "messages"),
    ("POST", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("POST", CHAT, {"messages": [{"role": "user"}]}, 400, "messages"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": "hi", "name": 7}]}, 400,
     "messages"),
    ("POST", CHAT, chat(top_logprobs=3), 400, "top_logprobs"),
    ("POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("POST", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    ("POST", CHAT, chat(logprobs=5), 400, "logprobs"),
    ("POST", CHAT, chat(max_completion_tokens=0), 400, "max_tokens"),
    ("POST", CHAT, chat(add_generation_prompt="no"), 400, "add_generation_prompt"),
    ("POST", CHAT, chat(tools=[{"type": "function"}]), 400, "tools"),
    # structured outputs: every constraint is compiled before the engine sees the request
    ("POST", CHAT, chat(response_format={"type": "xml"}), 400, "response_format"),
    ("POST", CHAT, chat(response_format={"type": "json_schema"}), 400, "response_format"),
    ("POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     400, "response_format"),
    ("POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}), 400, "response_format"),
    ("POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/missing"}}}), 400, "response_format"),
    ("POST", COMPLETIONS, completion(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "telephone"}}}), 400,
     "response_format"),
    ("POST", COMPLETIONS, completion(guided_json={"type": "object", "properties": {
        "a": {"not": {"type": "string"}}}}), 400, "guided_json"),
    ("POST", COMPLETIONS, completion(guided_json="{not json"), 400, "guided_json"),
    ("POST", COMPLETIONS, completion(guided_json=[1]), 400, "guided_json"),
    ("POST", COMPLETIONS, completion(guided_regex="a(b"), 400, "guided_regex"),
    ("POST", COMPLETIONS, completion(guided_regex="(?=a)b"), 400, "guided_regex"),
    ("POST", COMPLETIONS, completion(guided_choice=[]), 400, "guided_choice"),
    ("POST", COMPLETIONS, completion(guided_choice="yes"), 400, "guided_choice"),
    ("POST", COMPLETIONS, completion(guided_grammar="root ::= missing"), 400, "guided_grammar"),
    ("POST", COMPLETIONS, completion(guided_grammar="start: ("), 400, "guided_grammar"),
    ("POST", COMPLETIONS, completion(structured_outputs={}), 400, "structured_outputs"),
    ("POST", COMPLETIONS, completion(structured_outputs={"regex": "a", "choice": ["b"]}), 400,
     "structured_outputs"),
    ("POST", COMPLETIONS, completion(structured_outputs={"structural_tag": "{}"}), 400,
     "structured_outputs"),
    ("POST", COMPLETIONS, completion(structured_outputs={"json": {"type": 5}}), 400,
     "structured_outputs"),
    ("POST", COMPLETIONS, completion(structured_outputs={"regex": "[a-"}), 400,
     "structured_outputs"),
    ("POST", CHAT, chat(response_format={"type": "json_object"}, guided_regex="a+"), 400,
     "guided_regex"),
    ("POST", COMPLETIONS, completion(guided_regex="a" * 70000), 400, "guided_regex"),
    # tools
    ("POST", CHAT, chat(tools=[{"type": "function", "function": {"description": "no name"}}]),
     400, "tools"),
    ("POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400,
     "tools"),
    ("POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), 400,
     "tools"),
    ("POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}], tool_choice="required"), 400, "tools"),
    ("POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}}}],
        tool_choice="required"), 400, "tools"),
    ("POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                        tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice"),
    ("POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                        tool_choice="sometimes"), 400, "tool_choice"),
    ("POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                        tool_choice="required", response_format={"type": "json_object"}), 400,
     "tool_choice"),
    ("POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                        parallel_tool_calls="yes"), 400, "parallel_tool_calls"),
    ("POST", CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, 400,
     "messages"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, 400,
     "messages"),
    ("POST", COMPLETIONS, completion(tools=[{"type": "function", "function": {"name": "f"}}]),
     400, "tools"),
    # tokenize, detokenize
    ("POST", "/tokenize", {}, 400, "prompt"),
    ("POST", "/tokenize", {"prompt": "hi", "messages": USER}, 400, "prompt"),
    ("POST", "/tokenize", {"prompt": 5}, 400, "prompt"),
    ("POST", "/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("POST", "/tokenize", {"prompt": "hi", "add_special_tokens": "no"}, 400,
     "add_special_tokens"),
    ("POST", "/detokenize", {}, 400, "tokens"),
    ("POST", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("POST", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("POST", "/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("POST", "/detokenize", {"tokens": [1.5]}, 400, "tokens"),
    # the body itself, routes, methods
    ("POST", COMPLETIONS, b"{not json", 400, None),
    ("POST", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    ("POST", COMPLETIONS, b"[1, 2]", 400, None),
    ("POST", COMPLETIONS, b'"hi"', 400, None),
    ("POST", COMPLETIONS, b"null", 400, None),
    ("POST", COMPLETIONS, b"", 400, None),
    ("POST", CHAT, b"[]", 400, None),
    ("POST", "/detokenize", b"17", 400, None),
    ("POST", COMPLETIONS, b" " * (8 << 20) + b"{}", 413, None),
    ("GET", "/v1/nope", None, 404, None),
    ("POST", "/nope", {}, 404, None),
    ("GET", COMPLETIONS, None, 405, None),
    ("DELETE", "/v1/models", None, 405, None),
]


def send(base_url: str, method: str, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        kwargs["content"] = body
        kwargs.setdefault("headers", {})["content-type"] = "application/json"
    elif body is not None:
        kwargs["json"] = body
    return httpx.request(method, base_url + path, timeout=30, **kwargs)


# OpenAI's form (docs/api.md#errors): ``code`` is a string naming the condition, or null;
# never the HTTP status. The codes a table row can get, by (status, param):
CODES = {(404, "model"): "model_not_found", (413, None): "request_too_large"}


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == CODES.get((status, param)), error
    assert error["param"] == param, error


@pytest.mark.parametrize("method,path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{r[1]}-{r[4]}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_an_openai_error(tiny_server, method, path, body, status, param) -> None:
    assert_openai_error(send(tiny_server.base_url, method, path, body), status, param)


def test_request_id_longer_than_the_cap_is_refused(tiny_server) -> None:
    r = send(tiny_server.base_url, "POST", COMPLETIONS, completion(max_tokens=1),
             headers={"x-request-id": "r" * 257})
    assert_openai_error(r, 400, "x-request-id")


def test_server_keeps_serving_and_leaks_no_block_after_bad_input(tiny_server, client) -> None:
    assert len({(r[0], r[1], repr(r[2])) for r in BAD_REQUESTS}) == len(BAD_REQUESTS) >= 40
    for method, path, body, _, _ in BAD_REQUESTS:
        send(tiny_server.base_url, method, path, body)
    result = client.completions.create(model="tiny", prompt="still alive", max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 3
    idle = tiny_server.wait_idle()
    assert idle["tokenmill_num_tokens_waiting"] == 0
    assert idle["tokenmill_request_success_total{finished_reason=error}"] == 0


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
    assert httpx.post(base + "/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    models = httpx.get(base + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    assert httpx.get(base + "/version").json()["version"]
    assert httpx.get(base + "/health").status_code == 200
