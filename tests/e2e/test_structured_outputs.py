"""Structured outputs and tool calls through the real server and the official ``openai``
client, every mode streamed and not, on the tiny random-weight model: whatever a random
model writes under a grammar is valid, and usage stays exact chunk by chunk."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "Describe a person as JSON."}]
SAMPLE = {"temperature": 0.8, "seed": 5}
USAGE = {"include_usage": True, "continuous_usage_stats": True}
# (small: the tiny model's context is 256 tokens, and its tokenizer spends many on JSON)
CLOSED = {"additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], **CLOSED}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"], **CLOSED}}}


def chunks_of(stream) -> tuple[list, list]:
    """(chunks with a choice, all chunks); checks per-chunk usage: cumulative per choice,
    rising with every chunk, ending at the final usage."""
    chunks = list(stream)
    with_choice = [c for c in chunks if c.choices]
    per_choice: dict[int, list[int]] = {}
    for chunk in with_choice:
        per_choice.setdefault(chunk.choices[0].index, []).append(chunk.usage.completion_tokens)
    for counts in per_choice.values():
        assert counts == sorted(set(counts)), counts
    final = chunks[-1]
    assert final.choices == []
    assert final.usage.completion_tokens == sum(c[-1] for c in per_choice.values())
    return with_choice, chunks


# ------------------------------------------------------------------ JSON, chat


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    {"type": "json_object"},
])
def test_chat_json_streamed_and_not(client, response_format) -> None:
    max_tokens = 80 if response_format["type"] == "json_schema" else 40
    kwargs = dict(model="tiny", messages=USER, max_tokens=max_tokens,
                  response_format=response_format, **SAMPLE)
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    if response_format["type"] == "json_schema":
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    elif choice.finish_reason == "stop":  # any object: a random model may not close it
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")
    with_choice, _ = chunks_of(client.chat.completions.create(
        stream=True, stream_options=USAGE, **kwargs))
    assert "".join(c.choices[0].delta.content for c in with_choice) == choice.message.content
    assert [c.usage.completion_tokens for c in with_choice] == \
        list(range(1, full.usage.completion_tokens + 1))  # one token per chunk, exactly
    assert with_choice[-1].choices[0].finish_reason == choice.finish_reason


def test_parse_with_a_pydantic_model(client) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Pet(pydantic.BaseModel):
        kind: str = pydantic.Field(max_length=8)
        legs: int = pydantic.Field(ge=0, le=8)

    result = client.chat.completions.parse(model="tiny", messages=USER, max_tokens=80,
                                           response_format=Pet, **SAMPLE)
    assert isinstance(result.choices[0].message.parsed, Pet)


# -------------------------------------------------- vLLM's fields, both endpoints


CONSTRAINTS = [
    ({"structured_outputs": {"json": PERSON}}, "json"),
    ({"guided_json": PERSON}, "json"),
    ({"structured_outputs": {"regex": r"[a-z]{2,6}-[0-9]{3}"}}, r"[a-z]{2,6}-[0-9]{3}"),
    ({"guided_regex": r"(yes|no), [0-9]{1,2}"}, r"(yes|no), [0-9]{1,2}"),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, "red|green|blue"),
    ({"guided_choice": ["up", "down"]}, "up|down"),
    ({"structured_outputs": {"grammar": 'root ::= "(" [0-9] ("+" [0-9])* ")"'}},
     r"\([0-9](\+[0-9])*\)"),
    ({"guided_grammar": 'start: "say " ("hi" | "bye")'}, "say (hi|bye)"),
]


@pytest.mark.parametrize("extra,expected", CONSTRAINTS, ids=[str(c[0])[:40] for c in CONSTRAINTS])
def test_completions_with_vllm_fields(client, extra, expected) -> None:
    kwargs = dict(model="tiny", prompt="Answer:", max_tokens=100, n=2, extra_body=extra,
                  **SAMPLE)
    full = client.completions.create(**kwargs)
    for choice in full.choices:
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "stop"
        if expected == "json":
            jsonschema.validate(json.loads(choice.text), PERSON)
        else:
            assert re.fullmatch(expected, choice.text), choice.text
    with_choice, _ = chunks_of(client.completions.create(stream=True, stream_options=USAGE,
                                                         **kwargs))
    for index, choice in enumerate(full.choices):
        assert "".join(c.choices[0].text for c in with_choice
                       if c.choices[0].index == index) == choice.text


def test_constraints_with_stop_max_tokens_and_logprobs(client) -> None:
    schema = {"guided_json": PERSON}
    cut = client.completions.create(model="tiny", prompt="JSON:", max_tokens=5,
                                    extra_body=schema, **SAMPLE)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 5
    stopped = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=100, stop=['"age"'],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        logprobs=True, top_logprobs=3, **SAMPLE)
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and '"age"' not in choice.message.content
    assert choice.message.content.startswith("{")
    entries = choice.logprobs.content
    assert len(entries) == stopped.usage.completion_tokens
    assert all(-9999.0 <= top.logprob <= 0 for e in entries for top in e.top_logprobs)
    assert all(e.logprob > -9999.0 for e in entries), "a sampled token is always allowed"


# ------------------------------------------------------------------------- tools


def test_tool_choice_required_streamed_and_not(client) -> None:
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                  max_tokens=100, tools=[WEATHER, ADD], tool_choice="required",
                  parallel_tool_calls=False, **SAMPLE)
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    schema = {"weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    with_choice, _ = chunks_of(client.chat.completions.create(
        stream=True, stream_options=USAGE, **kwargs))
    first = with_choice[0].choices[0].delta
    assert first.role == "assistant" and first.tool_calls[0].function.name == call.function.name
    assert first.tool_calls[0].id.startswith("call_")
    arguments = "".join(d.function.arguments or "" for c in with_choice
                        for d in c.choices[0].delta.tool_calls or ())
    assert arguments == call.function.arguments
    assert with_choice[-1].choices[0].finish_reason == "tool_calls"
    assert with_choice[-1].usage.completion_tokens == full.usage.completion_tokens


def test_named_tool_choice_streamed_and_not(client) -> None:
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "add"}], max_tokens=60,
                  tools=[WEATHER, ADD], n=2,
                  tool_choice={"type": "function", "function": {"name": "add"}}, **SAMPLE)
    full = client.chat.completions.create(**kwargs)
    for choice in full.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    with_choice, _ = chunks_of(client.chat.completions.create(
        stream=True, stream_options=USAGE, **kwargs))
    for index, choice in enumerate(full.choices):
        deltas = [d for c in with_choice if c.choices[0].index == index
                  for d in c.choices[0].delta.tool_calls or ()]
        assert deltas[0].id and deltas[0].function.name == "add"
        assert "".join(d.function.arguments for d in deltas) == \
            choice.message.tool_calls[0].function.arguments


HERMES = 'Sure. <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'


def test_auto_tool_calls_are_parsed_and_a_round_trip_renders(client, tiny_server) -> None:
    """tool_choice auto: the model's Hermes-format call (forced here by a regex, as a random
    model would not write one) becomes ``tool_calls``; the conversation goes on with the
    assistant's call and the tool's answer."""
    question = [{"role": "user", "content": "weather?"}]
    kwargs = dict(model="tiny", messages=question, max_tokens=80, tools=[WEATHER],
                  extra_body={"guided_regex": re.escape(HERMES)}, **SAMPLE)
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("weather", {"city": "Oslo"})
    with_choice, _ = chunks_of(client.chat.completions.create(
        stream=True, stream_options=USAGE, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in with_choice)
    calls = [d for c in with_choice for d in c.choices[0].delta.tool_calls or ()]
    assert content == "Sure. " and len(calls) == 1 and calls[0].function.name == "weather"
    assert with_choice[-1].choices[0].finish_reason == "tool_calls"
    messages = question + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                            max_tokens=4, **SAMPLE)
    assert answer.usage.completion_tokens >= 1
    shown = httpx.post(tiny_server.base_url + "/tokenize",
                       json={"messages": messages, "tools": [WEATHER]}).json()
    assert shown["count"] == answer.usage.prompt_tokens
    none = client.chat.completions.create(model="tiny", messages=question, tools=[WEATHER],
                                          tool_choice="none", max_tokens=4, **SAMPLE)
    assert none.usage.prompt_tokens < answer.usage.prompt_tokens and \
        none.choices[0].message.tool_calls is None


def test_grammar_metrics_and_lifecycle(tiny_server, client) -> None:
    before = tiny_server.metrics()
    schema = {"type": "object", "properties": {"k": {"enum": ["metrics-test"]}},
              "required": ["k"], "additionalProperties": False}
    for _ in range(3):  # compiled once, then cached
        out = client.completions.create(model="tiny", prompt="x", max_tokens=30, extra_body={
            "structured_outputs": {"json": schema, "disable_any_whitespace": True}})
        assert json.loads(out.choices[0].text) == {"k": "metrics-test"}
    after = tiny_server.wait_idle()
    assert after["tokenmill_grammar_compilations_total"] - \
        before.get("tokenmill_grammar_compilations_total", 0) == 1
    assert after["tokenmill_grammar_compile_seconds_count"] - \
        before.get("tokenmill_grammar_compile_seconds_count", 0) == 1
    assert after["tokenmill_request_success_total{finished_reason=stop}"] - \
        before["tokenmill_request_success_total{finished_reason=stop}"] == 3


@pytest.mark.slow
def test_smollm2_writes_valid_json_and_refuses_auto_tools(smol_server) -> None:
    """The embedded model: schema-valid JSON at temperature 0.8 (its template renders no
    tools, so tool_choice auto is a 400, while required still works)."""
    from openai import BadRequestError, OpenAI

    smol = OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused", max_retries=0)
    model = smol.models.list().data[0].id
    full = smol.chat.completions.create(
        model=model, messages=USER, max_tokens=200, n=4, temperature=0.8, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    for choice in full.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    with pytest.raises(BadRequestError) as refused:
        smol.chat.completions.create(model=model, messages=USER, tools=[WEATHER], max_tokens=5)
    assert refused.value.body["param"] == "tool_choice"
    forced = smol.chat.completions.create(model=model, messages=USER, tools=[WEATHER],
                                          tool_choice="required", max_tokens=60)
    assert forced.choices[0].message.tool_calls[0].function.name == "weather"
