"""End-to-end serving: ``tokenmill serve`` under streaming clients, and what two options cost.

One run, one server at a time (embedded SmolLM2 unless ``--model``), every request a
``--input-len``-token prompt asking for exactly ``--output-len`` tokens (``ignore_eos``),
streamed from ``/v1/completions``:

1. latency and throughput: ``tokenmill bench`` (``run_benchmark``) at each concurrency
   in ``--concurrency`` (default 1, 4, 16): output tokens/s, TTFT and ITL p50/p99,
   next to the product's throughput targets (>= 75 tok/s for one stream, >= 700 at 16
   on a 2-core CPU) as ratios;
2. continuous usage: ``--compare-streams`` streams with
   ``stream_options.continuous_usage_stats`` on vs off (``include_usage`` on in both).
   The bench client always asks for it, so this part drives the bench client's own
   request, counting and summary code with the stream options fixed: tokens are
   counted from per-chunk usage (on) or from the final usage (off), totals exact in
   both. Ratio = on / off;
3. stats overhead: the same stream at ``--compare-streams`` against this server (stats
   on) and against a second one started with ``--disable-log-stats``. Ratio = on / off,
   target >= 0.97.

Parts 2 and 3 alternate their two sides ``--compare-rounds`` times (part 3 restarts the
servers in turn) and keep each side's best round: the machine is shared, and the best
round is the least disturbed. Each measurement uses its own prompt seed, so no prompt
is served from the prefix cache of an earlier one. Prints tables and writes JSON. Usage::

    python benchmarks/serve.py [--model PATH] [--input-len 128] [--output-len 128]
                               [--concurrency 1 4 16] [--requests-per-stream 2]
                               [--compare-streams 16] [--compare-rounds 2]
                               [--out FILE] [-- SERVER OPTIONS]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table

from tokenmill.bench import BenchConfig, BenchSetupError, Status, Summary, run_benchmark
from tokenmill.bench.counting import count_record
from tokenmill.bench.loadgen import drive
from tokenmill.bench.prompts import SyntheticPrompts
from tokenmill.bench.records import RawResponse
from tokenmill.bench.runner import open_client, resolve_model
from tokenmill.bench.stats import summarize
from tokenmill.bench.stream import Endpoint, send
from tokenmill.bench.tokenizers import ServerTokenCounter

TARGETS = {1: 75.0, 16: 700.0}  # output tok/s
STATS_TARGET = 0.97  # stats on / stats off, output tok/s
USAGE_ON = {"include_usage": True, "continuous_usage_stats": True}
USAGE_OFF = {"include_usage": True, "continuous_usage_stats": False}
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(model: str | None, extra: list[str]) -> Iterator[str]:
    """A ``tokenmill serve`` on a free loopback port until the block ends; yields its URL."""
    with server_process(model, extra) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def server_process(model: str | None, extra: list[str], own_session: bool = False,
                   ) -> Iterator[tuple[str, subprocess.Popen]]:
    """``running_server`` that also yields the process. ``own_session``: started in a
    session of its own (``setsid``), as a service manager or a container runtime starts
    it (with kernel autogroup, a scheduling group of its own)."""
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "--log-level", "warning", "serve",
               "--port", str(port), *([model] if model else []), *extra]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=own_session)
        try:
            yield wait_ready(server, f"http://127.0.0.1:{port}", log), server
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def wait_ready(server: subprocess.Popen, base_url: str, log) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            tail = log.read().decode("utf-8", "replace")[-2000:]
            raise SystemExit(f"the server exited with status {server.returncode}:\n{tail}")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return base_url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not start in {START_TIMEOUT_S} s")


async def stream_run(config: BenchConfig, stream_options: dict) -> Summary:
    """``run_benchmark`` with ``stream_options`` fixed (it would always ask for continuous
    usage): same prompts, load loop, stream reader, counting and summary."""
    async with open_client(config.timeout) as client:
        model = await resolve_model(client, config, {})
        counter = await ServerTokenCounter.probe(client, config.base_url, model, {})
        if counter is None:
            raise BenchSetupError("the server does not answer /tokenize")
        prompts = SyntheticPrompts(counter, config.input_len, config.output_len,
                                   config.range_ratio, config.seed)
        endpoint = Endpoint(f"{config.base_url}/v1/completions", False, model, {},
                            config.ignore_eos, stream_options)
        warmup = await prompts.warmup()
        raw = RawResponse(-1, warmup.max_tokens, warmup.num_tokens)
        await send(client, endpoint, warmup.text, raw, time.perf_counter())
        if raw.status is not Status.OK:
            raise BenchSetupError(f"the warm-up request failed: {raw.error}")
        ready = [await prompts.get(i) for i in range(config.num_requests)]
        raws: list[RawResponse] = []

        async def run_one(index: int) -> None:
            prompt = ready[index]
            raws.append(RawResponse(index, prompt.max_tokens, prompt.num_tokens))
            await send(client, endpoint, prompt.text, raws[-1], start_ts)

        start_ts = time.perf_counter()
        duration_s = await drive(config, run_one, start_ts)
    records = sorted((count_record(raw, None) for raw in raws), key=lambda r: r.index)
    return summarize(records, duration_s, {})


def row(summary: Summary, **extra) -> dict:
    return {
        **extra,
        "output_tok_s": summary.output_throughput,
        "ttft_p50_ms": summary.ttft_ms.p50, "ttft_p99_ms": summary.ttft_ms.p99,
        "itl_p50_ms": summary.itl_ms.p50, "itl_p99_ms": summary.itl_ms.p99,
        "tpot_mean_ms": summary.tpot_ms.mean,
        "requests_ok": summary.num_ok, "requests_failed": summary.num_failed,
        "output_tokens": summary.total_output_tokens, "duration_s": summary.duration_s,
        "counting_method": summary.counting_method, "client_cpus": summary.client_cpus,
    }


class Runner:
    """Makes each measurement's BenchConfig, with a fresh prompt seed every time."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._seeds = itertools.count(args.seed)

    def config(self, base_url: str, concurrency: int) -> BenchConfig:
        return BenchConfig(base_url=base_url, concurrency=concurrency,
                           num_requests=concurrency * self.args.requests_per_stream,
                           input_len=self.args.input_len, output_len=self.args.output_len,
                           ignore_eos=True, seed=next(self._seeds))

    def bench(self, base_url: str, concurrency: int) -> dict:
        summary = asyncio.run(run_benchmark(self.config(base_url, concurrency))).summary
        target = TARGETS.get(concurrency)
        return row(summary, concurrency=concurrency, target_tok_s=target,
                   ratio_to_target=summary.output_throughput / target if target else None)

    def streams(self, base_url: str, stream_options: dict, **extra) -> dict:
        config = self.config(base_url, self.args.compare_streams)
        return row(asyncio.run(stream_run(config, stream_options)), **extra)


def best(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: r["output_tok_s"])


def compared(on: list[dict], off: list[dict], target: float | None) -> dict:
    ratio = best(on)["output_tok_s"] / best(off)["output_tok_s"]
    return {"on": best(on), "off": best(off), "ratio_output_tok_s": ratio,
            "target": target, "meets_target": None if target is None else ratio >= target,
            "rounds_on": on, "rounds_off": off}


def measure(args: argparse.Namespace, server_args: list[str]) -> dict:
    runner = Runner(args)
    usage_on, usage_off, stats_on, stats_off = [], [], [], []
    with running_server(args.model, server_args) as base_url:
        rows = [runner.bench(base_url, c) for c in args.concurrency]
        for _ in range(args.compare_rounds):
            usage_on.append(runner.streams(base_url, USAGE_ON, continuous_usage_stats=True))
            usage_off.append(runner.streams(base_url, USAGE_OFF, continuous_usage_stats=False))
        stats_on.append(runner.streams(base_url, USAGE_ON, log_stats=True))
    for round_index in range(args.compare_rounds):
        with running_server(args.model, [*server_args, "--disable-log-stats"]) as base_url:
            stats_off.append(runner.streams(base_url, USAGE_ON, log_stats=False))
        if round_index + 1 < args.compare_rounds:
            with running_server(args.model, server_args) as base_url:
                stats_on.append(runner.streams(base_url, USAGE_ON, log_stats=True))
    return {
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "server_args": server_args, "cpu_count": os.cpu_count(), "args": vars(args),
        "rows": rows,
        "continuous_usage": compared(usage_on, usage_off, None),
        "stats": compared(stats_on, stats_off, STATS_TARGET),
    }


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def print_tables(report: dict) -> None:
    args = report["args"]
    console = Console(width=130)
    table = Table(title=f"tokenmill serve, {args['input_len']} in / {args['output_len']} out, "
                        f"{args['requests_per_stream']} requests per stream")
    for column in ("streams", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                   "ITL p99 ms", "TPOT ms", "ok", "target", "ratio"):
        table.add_column(column, justify="right")
    for r in report["rows"]:
        table.add_row(str(r["concurrency"]), f"{r['output_tok_s']:.1f}", ms(r["ttft_p50_ms"]),
                      ms(r["ttft_p99_ms"]), ms(r["itl_p50_ms"]), ms(r["itl_p99_ms"]),
                      ms(r["tpot_mean_ms"]), str(r["requests_ok"]),
                      f"{r['target_tok_s'] or '-'}",
                      f"{r['ratio_to_target']:.2f}" if r["ratio_to_target"] else "-")
    console.print(table)
    table = Table(title=f"{args['compare_streams']} streams, on vs off, best of "
                        f"{args['compare_rounds']} round(s) each")
    for column in ("option", "side", "output tok/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms",
                   "counted by", "ratio on/off", "target"):
        table.add_column(column, justify="right")
    for label, key in (("continuous usage", "continuous_usage"), ("server stats", "stats")):
        part = report[key]
        for side in ("on", "off"):
            r = part[side]
            last = side == "off"
            verdict = "" if part["target"] is None else (
                f">= {part['target']} {'ok' if part['meets_target'] else 'MISSED'}")
            table.add_row(label if not last else "", side, f"{r['output_tok_s']:.1f}",
                          ms(r["ttft_p50_ms"]), ms(r["itl_p50_ms"]), ms(r["itl_p99_ms"]),
                          r["counting_method"],
                          f"{part['ratio_output_tok_s']:.3f}" if last else "",
                          verdict if last else "", end_section=last)
    console.print(table)
    rounds = {key: [f"{r['output_tok_s']:.1f}" for r in report[key]["rounds_on"]] + ["|"]
              + [f"{r['output_tok_s']:.1f}" for r in report[key]["rounds_off"]]
              for key in ("continuous_usage", "stats")}
    console.print("every round, on | off (tok/s): continuous usage "
                  f"{' '.join(rounds['continuous_usage'])}; stats {' '.join(rounds['stats'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--compare-streams", type=int, default=16)
    parser.add_argument("--compare-rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="first prompt seed")
    parser.add_argument("--out", default="benchmarks/results/serve.json")
    args, server_args = parser.parse_known_args()
    server_args = [a for a in server_args if a != "--"]
    report = measure(args, server_args)
    print_tables(report)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
