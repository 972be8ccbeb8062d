"""Servers for the end-to-end tests: a tiny random-weight Llama (fast) and the embedded
SmolLM2, each started once per session as a real ``tokenmill serve`` process."""

from __future__ import annotations

import pytest
from openai import OpenAI
from server_process import ServerProcess

from tiny_model import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_server(tiny_model):
    server = ServerProcess(tiny_model, "--served-model-name", "tiny", "--max-model-len", "256",
                           "--metrics-vllm-names")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server():
    server = ServerProcess(None, "--max-model-len", "2048")
    yield server
    server.stop()


@pytest.fixture
def client(tiny_server) -> OpenAI:
    return OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0)
