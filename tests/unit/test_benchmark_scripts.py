"""The torch-free benchmark still runs against the current engine API (a short run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
