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


def test_serve_takes_the_model_as_an_argument_or_an_option() -> None:
    from tokenmill.cli import build_parser, engine_config_from

    parser, _ = build_parser()
    for argv in (["serve", "m.gguf"], ["serve", "--model", "m.gguf"],
                 ["serve", "m.gguf", "--model", "m.gguf"]):
        assert engine_config_from(parser.parse_args(argv)).model == "m.gguf"
    with pytest.raises(ValueError, match="two models"):
        engine_config_from(parser.parse_args(["serve", "a.gguf", "--model", "b.gguf"]))


def test_flags_come_from_the_settings_records() -> None:
    from tokenmill.cli import build_parser, engine_config_from, server_config_from
    from tokenmill.config import EngineConfig, RequestLimits, ServerConfig

    parser, _ = build_parser()
    args = parser.parse_args([
        "serve", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--kv-cache-memory", "2GiB",
        "--api-key", "a", "--api-key", "b", "--max-request-body-size", "1MiB", "--max-n", "4",
        "--port", "9000", "--disable-log-stats"])
    assert engine_config_from(args) == EngineConfig(max_num_seqs=8, enable_prefix_caching=False,
                                                    kv_cache_memory="2GiB")
    assert server_config_from(args) == ServerConfig(
        port=9000, api_keys=("a", "b"), disable_log_stats=True,
        limits=RequestLimits(max_request_body_bytes=1 << 20, max_n=4))


@pytest.mark.parametrize("args,message", [
    (["serve", "--no-such-flag"], "usage: tokenmill serve"),
    (["generate", "hi", "--no-such-flag"], "usage: tokenmill generate"),
])
def test_unknown_flags_show_the_subcommands_usage(args, message) -> None:
    result = run_cli(*args)
    assert result.returncode == 2 and message in result.stderr
    assert "unrecognized arguments: --no-such-flag" in result.stderr


def test_ray_without_ray_installed_says_what_to_install(monkeypatch, capsys) -> None:
    import importlib.util

    from tokenmill import cli

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real_find_spec(name, *a))
    assert cli.main(["serve", "--ray"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tokenmill: error: --ray needs Ray Serve, which is not installed: "
        "pip install 'tokenmill[ray]'")
