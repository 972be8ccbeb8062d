"""The command line as a user meets it: output on stdout, one-line errors, no tracebacks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tiny_model import make_tiny_model_dir


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-cli"))


@pytest.mark.slow
def test_generate_with_the_embedded_model() -> None:
    result = run_cli("generate", "The capital of France is", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Traceback" not in result.stderr


def test_generate_with_a_folder_model(tiny_model) -> None:
    from tokenmill import LLM, SamplingParams

    expected = LLM(tiny_model, dtype="float32").generate(
        ["hello"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    result = run_cli("generate", "hello", "--model", tiny_model, "--max-tokens", "6",
                     "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(expected.outputs[0].text[:3])


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "--model", "/no/such/model"], "/no/such/model"),
    (["generate", "hi", "--max-num-seqs", "0"], "max_num_seqs"),
    (["generate", "hi", "--dtype", "float8"], "dtype"),
    (["generate", "hi", "--kv-cache-memory", "lots"], "memory size"),
    (["serve", "/no/such/model.gguf"], "/no/such/model.gguf"),
])
def test_bad_input_gives_one_clear_line(args, message) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_corrupt_gguf_is_reported_cleanly(tmp_path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    result = run_cli("generate", "hi", "--model", str(bad))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "broken.gguf" in result.stderr
