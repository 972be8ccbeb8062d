"""The ``bench`` command: result JSON, plots, compare, and clear errors for bad input."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import pytest

from tokenmill.bench.cli import main, register


def bench(*argv: str) -> int:
    return main([*argv, "--no-progress"] if argv and argv[0] != "compare" else list(argv))


def test_run_writes_json_with_every_figure_and_plots(standin, tmp_path, capsys):
    _, root = standin
    out, plots = tmp_path / "a.json", tmp_path / "plots"
    code = bench("--base-url", f"{root}/k=2,delay=0.002/v1", "--input-len", "10",
                 "--output-len", "6", "--num-requests", "5", "--concurrency", "2",
                 "--goodput", "ttft:5000", "e2el:5000", "--result-json", str(out),
                 "--plot", str(plots))
    assert code == 0
    report = capsys.readouterr().out
    assert "output token throughput" in report and "continuous_usage" in report
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert (summary["num_ok"], summary["total_output_tokens"]) == (5, 30)
    assert summary["goodput"] == pytest.approx(5 / summary["duration_s"])
    assert set(summary["ttft_ms"]) == {"count", "mean", "p50", "p90", "p99"}
    assert data["info"]["model"] == "standin"  # the first of GET /v1/models
    record = data["requests"][0]
    for key in ("prompt_tokens", "output_tokens", "ttft_s", "itl_s", "e2e_s", "status", "error",
                "counting_method"):
        assert key in record
    assert record["counting_method"] == "continuous_usage" and len(record["itl_s"]) == 4
    for name in ("latency_cdf.png", "output_throughput.png", "ttft_vs_prompt.png"):
        png = (plots / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000
    # the report ends by saying where every file went, one absolute path per line
    assert report.splitlines()[-4:] == [f"wrote {out}"] + [
        f"wrote {plots / name}"
        for name in ("latency_cdf.png", "output_throughput.png", "ttft_vs_prompt.png")]


def test_relative_output_paths_are_reported_absolute(standin, tmp_path, monkeypatch, capsys):
    _, root = standin
    monkeypatch.chdir(tmp_path)
    assert bench("--base-url", f"{root}/k=1", "--input-len", "4", "--output-len", "2",
                 "--num-requests", "1", "--result-json", "r.json") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"wrote {tmp_path / 'r.json'}" and (tmp_path / "r.json").is_file()
    assert not any(line.startswith("wrote") for line in lines[:-1])


def test_compare_prints_both_runs_with_ratios(standin, tmp_path, capsys):
    _, root = standin
    paths = []
    for output_len in ("4", "8"):
        paths.append(str(tmp_path / f"run{output_len}.json"))
        assert bench("--base-url", f"{root}/k=1", "--input-len", "8", "--output-len", output_len,
                     "--num-requests", "3", "--result-json", paths[-1]) == 0
    capsys.readouterr()
    assert bench("compare", *paths) == 0
    table = capsys.readouterr().out
    assert "B/A" in table
    row = next(line for line in table.splitlines() if "output tokens " in line)
    assert "12" in row and "24" in row and "2.000" in row


def test_bad_arguments_exit_2_with_one_clear_line(standin, tmp_path, capsys):
    _, root = standin
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening
    url = f"{root}/k=1"
    cases = [
        ((), "--base-url is required"),
        (("--base-url", url, "--concurrency", "2", "--request-rate", "3"), "exclusive"),
        (("--base-url", url, "--concurrency", "0"), "--concurrency must be a positive"),
        (("--base-url", url, "--duration", "-1"), "--duration must be a positive"),
        (("--base-url", url, "--request-rate", "0"), "--request-rate must be a positive"),
        (("--base-url", url, "--input-len", "0"), "--input-len must be a positive"),
        (("--base-url", url, "--dataset", str(tmp_path / "missing.jsonl")), "--dataset"),
        (("--base-url", url, "--dataset", str(bad_json)), "bad.jsonl:2: needs a \"prompt\""),
        (("--base-url", url, "--goodput", "ttft=3"), "--goodput takes KEY:MS"),
        (("--base-url", url, "--goodput", "speed:3"), "--goodput keys are"),
        (("--base-url", "localhost:8000"), "--base-url must start with http"),
        (("--base-url", dead_url), "cannot reach the server"),
        (("compare", str(bad_json), str(bad_json)), "is not JSON"),
    ]
    for argv, message in cases:
        assert bench(*argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("tokenmill bench: error: ") and message in err, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err
    closed.close()


def test_python_dash_m_runs_and_reports_errors_without_traceback():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "tokenmill.bench", "--concurrency", "1"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == ("tokenmill bench: error: --base-url is required (the server to "
                           "measure, e.g. --base-url http://127.0.0.1:8000)\n")


def test_register_adds_bench_with_compare_to_a_main_parser(tmp_path):
    parser = argparse.ArgumentParser(prog="tokenmill")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "compare", "a.json", "b.json"])
    assert (args.command, args.bench_action, args.a, args.b) == ("bench", "compare", "a.json",
                                                                 "b.json")
    args = parser.parse_args(["bench", "--base-url", "http://x", "--concurrency", "0"])
    assert args.bench_action is None and args.func(args) == 2
