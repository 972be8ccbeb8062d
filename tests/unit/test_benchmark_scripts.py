"""The benchmarks still run against the current engine API (short runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_scheduler_benchmark_runs(tmp_path) -> None:
    out = tmp_path / "scheduler.json"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "scheduler.py"), "--many", "2000",
         "--steps", "100", "--block", "50", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    for part in ("scheduler", "engine"):
        assert report[part]["few"]["steps"] == report[part]["many"]["steps"] == 100
        assert report[part]["ratio_median"] > 0


def test_prefill_attention_benchmark_runs(tmp_path) -> None:
    out = tmp_path / "prefill_attention.json"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "prefill_attention.py"),
         "--prompt-len", "64", "--chunk", "32", "--short", "2", "--short-len", "16",
         "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and "no native prefill attention here" in result.stderr:
        pytest.skip("this CPU has no native prefill attention (AVX512-BF16)")
    assert result.returncode == 0, result.stderr
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 2 and all(case["ratio"] > 0 for case in cases.values())
