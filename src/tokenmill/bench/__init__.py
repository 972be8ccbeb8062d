"""``tokenmill bench``: a load generator and report for any OpenAI-compatible server.

It imports nothing else from tokenmill, so it measures other servers the same way.
API::

    from tokenmill.bench import BenchConfig, run_benchmark
    result = asyncio.run(run_benchmark(BenchConfig(base_url="http://127.0.0.1:8000")))
    result.summary.output_throughput, result.requests[0].itl_s, result.write_json(path)

Module map: config (settings) -> prompts/tokenizers (what to send) -> loadgen (when)
-> stream (one request, raw) -> counting (tokens and timings) -> stats (figures)
-> results/report/plots (JSON, tables, PNGs); runner ties them; cli is the command.
"""

from __future__ import annotations

from tokenmill.bench.config import BenchConfig, BenchConfigError, BenchSetupError
from tokenmill.bench.records import CountingMethod, RequestRecord, Status
from tokenmill.bench.results import BenchResult, load_result_json
from tokenmill.bench.runner import run_benchmark
from tokenmill.bench.stats import Distribution, Summary

__all__ = [
    "BenchConfig", "BenchConfigError", "BenchResult", "BenchSetupError", "CountingMethod",
    "Distribution", "RequestRecord", "Status", "Summary", "load_result_json", "run_benchmark",
]
