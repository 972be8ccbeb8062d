"""End-to-end serving throughput: ``tokenmill serve`` measured by ``tokenmill bench``.

Starts the server on a free loopback port (embedded SmolLM2 unless ``--model``), then
runs the benchmark client at each concurrency in ``--concurrency`` (default 1 and 16)
with fixed-length synthetic prompts, all in one run, and reports output tokens/s next
to the product's targets (>= 75 tok/s for one stream, >= 700 at 16 streams on a
2-core CPU) as ratios. Prints a table and writes JSON. Usage::

    python benchmarks/serving.py [--model PATH] [--input-len 128] [--output-len 128]
                                 [--concurrency 1 16] [--out FILE] [-- SERVER OPTIONS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
from rich.console import Console
from rich.table import Table

from tokenmill.bench import BenchConfig, run_benchmark

TARGETS = {1: 75.0, 16: 700.0}  # output tok/s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *extra]
    if model:
        command.insert(4, model)
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return server, base_url
        except httpx.TransportError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the server did not start in 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/serving.json")
    args, server_args = parser.parse_known_args()
    server_args = [a for a in server_args if a != "--"]
    server, base_url = start_server(args.model, server_args)
    rows = []
    try:
        for concurrency in args.concurrency:
            config = BenchConfig(base_url=base_url, concurrency=concurrency,
                                 num_requests=concurrency * args.requests_per_stream,
                                 input_len=args.input_len, output_len=args.output_len,
                                 ignore_eos=True)
            summary = asyncio.run(run_benchmark(config)).summary
            target = TARGETS.get(concurrency)
            rows.append({
                "concurrency": concurrency,
                "output_tok_s": summary.output_throughput,
                "ttft_p50_ms": summary.ttft_ms.p50,
                "tpot_mean_ms": summary.tpot_ms.mean,
                "target_tok_s": target,
                "ratio_to_target": summary.output_throughput / target if target else None,
                "requests_ok": summary.num_ok,
            })
    finally:
        server.terminate()
        server.wait(timeout=30)
    table = Table(title=f"tokenmill serve, {args.input_len} in / {args.output_len} out")
    for column in ("streams", "output tok/s", "TTFT p50 ms", "TPOT ms", "target", "ratio"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["concurrency"]), f"{row['output_tok_s']:.1f}",
                      f"{row['ttft_p50_ms']:.0f}", f"{row['tpot_mean_ms']:.1f}",
                      f"{row['target_tok_s'] or '-'}",
                      f"{row['ratio_to_target']:.2f}" if row["ratio_to_target"] else "-")
    Console().print(table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model or "embedded SmolLM2-135M-Instruct",
                   "server_args": server_args, "cpu_count": os.cpu_count(), "rows": rows}, f,
                  indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
