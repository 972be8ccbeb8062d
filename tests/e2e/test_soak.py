"""Two minutes of benchmarks/soak.py against a real server on the tiny model: mixed
streaming and non-streaming load with n > 1, abandoned requests, bad requests and
preemption, then the audit (exact usage, counters = sums, every abort counted, no block
held, gauges at zero, bounded RSS growth).

The RSS check compares medians of 15 s of samples, the first taken once the warm-up has
lasted 30 s and 400 requests (a slow host takes longer to meet the load's shapes), the
last after 90 s more of load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.soak
@pytest.mark.timeout(420)
def test_two_minute_soak_loses_nothing(tiny_model, tmp_path) -> None:
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--model", tiny_model,
         "--duration", "90", "--warmup", "30", "--warmup-requests", "400",
         "--rss-window", "15", "--out", str(out)],
        capture_output=True, text=True, timeout=400)
    assert out.exists(), result.stdout + result.stderr
    report = json.loads(out.read_text())
    failed = [name for name, held in report["checks"].items() if not held]
    assert not failed, (failed, report["errors"], result.stdout[-3000:])
    assert result.returncode == 0
    tally = report["tally"]
    assert tally["aborted_requests"] > 0 and tally["bad_requests"] > 0
    assert report["metrics"]["tokenmill_num_preemptions_total"] > 0
