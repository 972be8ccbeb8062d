"""Ray Serve scale-out on one host: 1 replica vs 2 replicas (half the cores each) with the
token-aware router vs 2 with Serve's default router, under a mix of long and short prompts.

Each configuration is a fresh ``tokenmill serve --ray`` (its own local Ray instance) and
one ``tokenmill bench`` run against it: a JSONL dataset alternating one long prompt
(``--long-len`` words, 8 output tokens) with ``--shorts-per-long`` short ones (16 output
tokens), at ``--concurrency`` streams. Reported per configuration: TTFT p50/p99 of the
short requests and total token throughput (prompt + output tokens / s), and the ratio of
each to the 1-replica run. Usage::

    python benchmarks/ray_serve.py [--model PATH] [--num-requests 60] [--concurrency 6]
                                   [--long-len 900] [--shorts-per-long 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table

WORDS = ("the quick brown fox jumps over the lazy dog while servers batch many requests "
         "together so that the hardware stays busy").split()
CONFIGS = (
    ("1 replica, 2 CPUs", ["--min-replicas", "1", "--replica-num-cpus", "2"]),
    ("2 replicas, token-load router", ["--min-replicas", "2", "--replica-num-cpus", "1",
                                       "--request-router", "token-load"]),
    ("2 replicas, default router", ["--min-replicas", "2", "--replica-num-cpus", "1",
                                    "--request-router", "default"]),
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dataset(path: str, long_len: int, shorts_per_long: int) -> None:
    with open(path, "w") as f:
        for i in range(64):
            long_prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(long_len))
            f.write(json.dumps({"prompt": long_prompt, "max_tokens": 8}) + "\n")
            for j in range(shorts_per_long):
                f.write(json.dumps({"prompt": f"{i} {j} Write a short poem about the sea.",
                                    "max_tokens": 16}) + "\n")


def _run(name: str, options: list[str], args, dataset: str, workdir: str) -> dict:
    port = _free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--ray", "--port", str(port),
               "--max-model-len", "2048", *options] + ([args.model] if args.model else [])
    log = open(os.path.join(workdir, f"server-{port}.log"), "w")  # noqa: SIM115
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: server did not start (log in {log.name})")
            time.sleep(0.5)
        result = os.path.join(workdir, f"bench-{port}.json")
        subprocess.run([sys.executable, "-m", "tokenmill.bench", "--base-url",
                        f"http://127.0.0.1:{port}", "--dataset", dataset, "--num-requests",
                        str(args.num_requests), "--concurrency", str(args.concurrency),
                        "--ignore-eos", "--no-progress", "--result-json", result],
                       check=True, stdout=subprocess.DEVNULL)
        with open(result) as f:
            report = json.load(f)
    finally:
        server.terminate()
        server.wait(timeout=120)
        log.close()
    shorts = sorted(r["ttft_s"] * 1000 for r in report["requests"]
                    if r["status"] == "ok" and r["max_tokens"] == 16)
    p99_index = min(len(shorts) - 1, round(0.99 * (len(shorts) - 1)))
    return {"config": name, "short_requests": len(shorts),
            "short_ttft_p50_ms": statistics.median(shorts),
            "short_ttft_p99_ms": shorts[p99_index],
            "total_tok_s": report["summary"]["total_token_throughput"],
            "failed": report["summary"]["num_failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--long-len", type=int, default=900)
    parser.add_argument("--shorts-per-long", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/ray_serve.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        dataset = os.path.join(workdir, "mix.jsonl")
        _dataset(dataset, args.long_len, args.shorts_per_long)
        rows = [_run(name, options, args, dataset, workdir) for name, options in CONFIGS]
    base = rows[0]
    table = Table(title="Ray Serve on one host: long + short prompts")
    for column in ("config", "short TTFT p50 (ms)", "p99 (ms)", "total tok/s",
                   "p50 ratio", "p99 ratio", "tok/s ratio", "failed"):
        table.add_column(column)
    for row in rows:
        row["ratios_to_one_replica"] = {
            key: row[key] / base[key] for key in
            ("short_ttft_p50_ms", "short_ttft_p99_ms", "total_tok_s")}
        r = row["ratios_to_one_replica"]
        table.add_row(row["config"], f"{row['short_ttft_p50_ms']:.0f}",
                      f"{row['short_ttft_p99_ms']:.0f}", f"{row['total_tok_s']:.1f}",
                      f"{r['short_ttft_p50_ms']:.2f}", f"{r['short_ttft_p99_ms']:.2f}",
                      f"{r['total_tok_s']:.2f}", str(row["failed"]))
    Console().print(table)
    print("ratios: configuration / 1 replica (TTFT below 1 is better, tok/s above 1)")
    write_report({"args": vars(args), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
