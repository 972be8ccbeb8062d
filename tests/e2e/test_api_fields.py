"""Request fields beyond the basics, through the official client: logprobs, stop, seed,
lists of prompts; the continuous-usage default; a clean exit on SIGTERM."""

from __future__ import annotations

import math
import signal

import pytest
from openai import OpenAI
from server_process import ServerProcess


def test_completion_logprobs(client) -> None:
    result = client.completions.create(model="tiny", prompt="The sky is", max_tokens=4,
                                       logprobs=3, temperature=0.0, user="tester",
                                       extra_body={"ignore_eos": True})
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and logprob <= 0
        assert math.isclose(max(top.values()), logprob, abs_tol=1e-4)  # greedy: the best
    assert len(lp.tokens) == result.usage.completion_tokens


def test_chat_logprobs(client) -> None:
    result = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2, temperature=0.0, extra_body={"ignore_eos": True})
    content = result.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-4
               for c in content)


def test_list_of_prompts_and_seeded_sampling(client) -> None:
    result = client.completions.create(model="tiny", prompt=["first prompt", "second one"],
                                       max_tokens=3, n=2, seed=5, temperature=1.0,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    again = client.completions.create(model="tiny", prompt=["first prompt", "second one"],
                                      max_tokens=3, n=2, seed=5, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in result.choices] == [c.text for c in again.choices]
    assert result.usage.completion_tokens == 12


def test_stop_string_ends_the_choice(client) -> None:
    full = client.completions.create(model="tiny", prompt="Tell me", max_tokens=16,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[4:7]
    cut = client.completions.create(model="tiny", prompt="Tell me", max_tokens=16, stop=[stop],
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_stream_on_its_token(tiny_server, client, include) -> None:
    """Streamed with usage on every chunk: the text ends at the stop string (or just after
    it), each chunk carries one more token, a finish chunk without one follows (its usage
    repeats the count), and the engine generated no token past the one that completed the
    stop string."""
    full = client.completions.create(model="tiny", prompt="Tell me", max_tokens=16,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[4:7]
    end = text.index(stop) + (len(stop) if include else 0)
    before = tiny_server.wait_idle()
    chunks = list(client.completions.create(
        model="tiny", prompt="Tell me", max_tokens=16, stop=[stop], temperature=0.0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "include_stop_str_in_output": include}))
    after = tiny_server.wait_idle()
    *with_tokens, finish = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_tokens) == text[:end]
    assert all(c.choices[0].finish_reason is None for c in with_tokens)
    assert finish.choices[0].text == "" and finish.choices[0].finish_reason == "stop"
    assert finish.choices[0].model_extra["stop_reason"] == stop
    counts = [c.usage.completion_tokens for c in with_tokens]
    assert counts == list(range(1, len(counts) + 1))
    assert finish.usage.completion_tokens == chunks[-1].usage.completion_tokens == counts[-1]
    assert counts[-1] < 16
    generated = after["tokenmill_generation_tokens_total"] - before[
        "tokenmill_generation_tokens_total"]
    assert generated == counts[-1]


def test_default_continuous_usage_then_sigterm(tiny_model) -> None:
    """--default-continuous-usage-stats: streams that say nothing get usage on every chunk;
    then SIGTERM shuts the server down gracefully."""
    server = ServerProcess(tiny_model, "--default-continuous-usage-stats")
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        chunks = list(client.completions.create(model=model, prompt="hi", max_tokens=3,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 3]
        assert chunks[-1].choices == []
        opted_out = list(client.completions.create(
            model=model, prompt="hi", max_tokens=3, stream=True,
            stream_options={"include_usage": False}, extra_body={"ignore_eos": True}))
        assert all(c.usage is None for c in opted_out) and len(opted_out) == 3
        server.process.send_signal(signal.SIGTERM)
        # uvicorn finishes its graceful shutdown, then re-raises the signal it caught
        assert server.process.wait(timeout=30) in (0, -signal.SIGTERM)
        log = server.log()
        assert "Application shutdown complete" in log and "Traceback" not in log
    finally:
        server.stop()
