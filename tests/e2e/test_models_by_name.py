"""Models named by Hub repository, fetched from a local stand-in for the Hub
(``HF_ENDPOINT``): ``serve org/repo`` downloads once into ``HF_HOME`` and serves the model
under that name; with ``HF_HUB_OFFLINE`` the cache serves it without a request; a local
path of the same name wins; ``org/repo:QUANT`` fetches only that GGUF file; a missing
repository, file or cache entry is one line on stderr, exit status 2."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys

import httpx
import pytest
from server_process import ServerProcess

from hub_stand_in import HubStandIn


@pytest.fixture(scope="module")
def hub(tiny_model, tmp_path_factory):
    ggufs = tmp_path_factory.mktemp("gguf-repo")
    for name in ("tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", "tiny.f32.gguf"):
        (ggufs / name).write_bytes(name.encode() * 1000)
    stand_in = HubStandIn({"tiny/llama": tiny_model, "tiny/llama-GGUF": str(ggufs)})
    yield stand_in
    stand_in.close()


def hub_env(hub: HubStandIn, hf_home, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(hf_home), **extra}


def tokenmill(*args: str, env: dict[str, str], cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_serve_fetches_a_repo_once_then_the_cache_serves_it_offline(hub, tmp_path) -> None:
    hf_home = tmp_path / "hf"
    server = ServerProcess("tiny/llama", "--max-model-len", "128",
                           env=hub_env(hub, hf_home, HF_HUB_OFFLINE="0"))
    try:
        models = httpx.get(server.base_url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny/llama"]
        answer = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": "tiny/llama", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert answer.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    snapshot = hf_home / "hub" / "models--tiny--llama" / "snapshots" / hub.commit("tiny/llama")
    assert (snapshot / "model.safetensors").is_file()

    asked = len(hub.requests)
    offline = tokenmill("generate", "hello", "--model", "tiny/llama", "--max-tokens", "4",
                        env=hub_env(hub, hf_home, HF_HUB_OFFLINE="1"))
    assert offline.returncode == 0, offline.stderr
    assert len(hub.requests) == asked, hub.requests[asked:]


def test_a_local_folder_wins_over_the_repo_of_that_name(hub, tiny_model, tmp_path) -> None:
    shutil.copytree(tiny_model, tmp_path / "tiny" / "llama")
    asked = len(hub.requests)
    result = tokenmill("generate", "hello", "--model", "tiny/llama", "--max-tokens", "2",
                       env=hub_env(hub, tmp_path / "hf"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert hub.requests[asked:] == []
    assert not (tmp_path / "hf" / "hub").exists()


def test_a_quant_tag_fetches_that_gguf_file_only(hub, tmp_path) -> None:
    env = hub_env(hub, tmp_path / "hf")
    code = ("import sys; from tokenmill.model_hub import local_model; "
            "print(local_model(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", code, "tiny/llama-GGUF:q8_0"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    path = result.stdout.strip()
    assert os.path.basename(path) == "tiny-Q8_0.gguf"
    assert filecmp.cmp(path, os.path.join(hub.repos["tiny/llama-GGUF"], "tiny-Q8_0.gguf"),
                       shallow=False)
    assert os.listdir(os.path.dirname(path)) == ["tiny-Q8_0.gguf"]


@pytest.mark.parametrize(("model", "offline", "message"), [
    ("nobody/nothing", "0", "no model repository nobody/nothing on http://127.0.0.1:"),
    ("tiny/llama-GGUF:Q5_K_M", "0", "tiny/llama-GGUF has no GGUF files ending in Q5_K_M; pick "
     "one as tiny/llama-GGUF:QUANT or tiny/llama-GGUF:FILE from: tiny-Q4_K_M.gguf, "
     "tiny-Q8_0.gguf, tiny.f32.gguf"),
    ("tiny/llama-GGUF:tiny-Q2_K.gguf", "0", "tiny/llama-GGUF has no GGUF file tiny-Q2_K.gguf"),
    ("tiny/llama", "1", "tiny/llama is not in the Hugging Face cache, and HF_HUB_OFFLINE is set"),
])
def test_a_missing_repo_file_or_cache_entry_is_one_clear_line(hub, tmp_path, model, offline,
                                                               message) -> None:
    result = tokenmill("serve", model, env=hub_env(hub, tmp_path / "hf", HF_HUB_OFFLINE=offline))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenmill: error: ") and message in last, result.stderr
