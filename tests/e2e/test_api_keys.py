"""API keys: several may be valid at once (rotation), or one comes from the environment;
``/v1/*`` refuses a missing, wrong or nearly right key with 401; other routes stay open."""

from __future__ import annotations

import httpx
import pytest
from openai import AuthenticationError, OpenAI
from server_process import ServerProcess

from tokenmill.server.middleware import api_key_matches

KEYS = ("old-key-0123456789", "new-key-9876543210")
NEAR_MISSES = [
    None,  # no header at all
    "",
    "Bearer",
    "Bearer wrong",
    f"Bearer {KEYS[0][:-1]}",  # a prefix
    f"Bearer {KEYS[0]}x",  # one character more
    f"Bearer {KEYS[0][:-1]}8",  # the last character changed
    f"Bearer {KEYS[0].upper()}",
    f"Basic {KEYS[0]}",  # the wrong scheme
    KEYS[0],  # no scheme
    f"Bearer {KEYS[0]},{KEYS[1]}",
]


@pytest.mark.parametrize("authorization", NEAR_MISSES)
def test_near_misses_do_not_match(authorization) -> None:
    assert not api_key_matches(authorization, KEYS)


def test_every_configured_key_matches() -> None:
    for key in KEYS:
        assert api_key_matches(f"Bearer {key}", KEYS)
        assert api_key_matches(f"bearer {key}", KEYS)  # the scheme is case-insensitive
    assert not api_key_matches(f"Bearer {KEYS[0]}", ())


def test_rotated_keys_on_a_real_server(tiny_model) -> None:
    server = ServerProcess(tiny_model, "--api-key", KEYS[0], "--api-key", KEYS[1])
    try:
        for authorization in NEAR_MISSES:
            headers = {} if authorization is None else {"authorization": authorization}
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                r = httpx.request(method, server.base_url + path, headers=headers, timeout=30,
                                  json={"prompt": "hi", "max_tokens": 1})
                assert r.status_code == 401, (authorization, path, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
        for key in KEYS:
            client = OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
            result = client.completions.create(model=client.models.list().data[0].id,
                                               prompt="hi", max_tokens=2)
            assert result.usage.completion_tokens >= 1
        for path in ("/health", "/metrics", "/version"):  # not behind the key
            assert httpx.get(server.base_url + path).status_code == 200
    finally:
        server.stop()


def test_key_from_the_environment(tiny_model) -> None:
    server = ServerProcess(tiny_model, env={"TOKENMILL_API_KEY": "from-env"})
    try:
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=server.base_url + "/v1", api_key="wrong",
                   max_retries=0).models.list()
        good = OpenAI(base_url=server.base_url + "/v1", api_key="from-env", max_retries=0)
        assert good.models.list().data
    finally:
        server.stop()
