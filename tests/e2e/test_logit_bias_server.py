"""logit_bias through the server and the openai client: it forces and bans tokens."""

from __future__ import annotations

import httpx


def token_ids(base_url: str, text: str) -> list[int]:
    return httpx.post(base_url + "/tokenize", json={"prompt": text,
                                                    "add_special_tokens": False}).json()["tokens"]


def test_logit_bias_forces_and_bans_tokens(client, tiny_server) -> None:
    common = dict(model="tiny", prompt="the cat sat on", max_tokens=6, temperature=0.0,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**common).choices[0].text
    forced_token = next(t for t in range(5, 400)
                        if t not in token_ids(tiny_server.base_url, plain))
    forced = client.completions.create(**common, logit_bias={str(forced_token): 100})
    expected = httpx.post(tiny_server.base_url + "/detokenize",
                          json={"tokens": [forced_token] * 6}).json()["prompt"]
    assert forced.choices[0].text == expected
    banned_ids = set(token_ids(tiny_server.base_url, plain))
    banned = client.completions.create(**common, logit_bias={str(t): -100 for t in banned_ids})
    assert banned.choices[0].text != plain
    assert banned.usage.completion_tokens == 6
