"""The server on a shared host: streaming throughput alone vs beside low-priority CPU hogs.

Starts ``tokenmill serve`` once and streams ``--streams`` concurrent requests
(``--input-len`` prompt tokens, exactly ``--output-len`` output tokens) three times in
turn: alone, beside ``--hogs`` busy-looping processes at ``nice -n 19`` (one per core by
default, as a batch job sharing the machine would be), and alone again. Prints each
round's output tok/s and TTFT/ITL, and the ratio shared / alone (alone = the better of
the two alone rounds). Target: >= 0.5 on a 2-core host. Usage::

    python benchmarks/shared_host.py [--streams 16] [--hogs N] [--out FILE] [-- SERVER OPTIONS]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table
from serve import ms, row, running_server

from tokenmill.bench import BenchConfig, run_benchmark

TARGET = 0.5
HOG = "while True: pass"


@contextlib.contextmanager
def hogs(count: int) -> Iterator[None]:
    """``count`` busy loops at the lowest priority until the block ends."""
    procs = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", HOG])
             for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def measure(args: argparse.Namespace, server_args: list[str]) -> dict:
    rounds = []
    with running_server(None, server_args) as base_url:
        for seed, (label, hog_count) in enumerate(
                [("alone", 0), ("shared", args.hogs), ("alone again", 0)]):
            config = BenchConfig(base_url=base_url, concurrency=args.streams,
                                 num_requests=args.streams * args.requests_per_stream,
                                 input_len=args.input_len, output_len=args.output_len,
                                 ignore_eos=True, seed=seed)
            with hogs(hog_count):
                summary = asyncio.run(run_benchmark(config)).summary
            rounds.append(row(summary, round=label, hogs=hog_count))
            print(f"  {label}: {summary.output_throughput:.1f} tok/s", flush=True)
    alone = max(rounds[0]["output_tok_s"], rounds[2]["output_tok_s"])
    ratio = rounds[1]["output_tok_s"] / alone
    return {"server_args": server_args, "args": vars(args), "cpu_count": os.cpu_count(),
            "rounds": rounds, "ratio_shared_to_alone": ratio, "target": TARGET,
            "meets_target": ratio >= TARGET}


def print_table(report: dict) -> None:
    args = report["args"]
    table = Table(title=f"{args['streams']} streams, {args['input_len']} in / "
                        f"{args['output_len']} out, beside {args['hogs']} nice-19 busy loops")
    for column in ("round", "hogs", "output tok/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms"):
        table.add_column(column, justify="right")
    for r in report["rounds"]:
        table.add_row(r["round"], str(r["hogs"]), f"{r['output_tok_s']:.1f}",
                      ms(r["ttft_p50_ms"]), ms(r["itl_p50_ms"]), ms(r["itl_p99_ms"]))
    Console(width=110).print(table)
    verdict = "ok" if report["meets_target"] else "MISSED"
    print(f"shared / alone: {report['ratio_shared_to_alone']:.2f} "
          f"(target >= {report['target']}: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests-per-stream", type=int, default=1)
    parser.add_argument("--hogs", type=int, default=os.cpu_count())
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/shared_host.json")
    args, server_args = parser.parse_known_args()
    report = measure(args, [a for a in server_args if a != "--"])
    print_table(report)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
