"""The server on a shared host: streaming throughput alone vs given less of the machine.

Starts ``tokenmill serve`` once, in a session of its own (``setsid``, as a service
manager or a container runtime starts it: with kernel autogroup, a scheduling group of
its own, out of reach of ``nice`` in other sessions), and streams ``--streams``
concurrent requests (``--input-len`` prompt tokens, exactly ``--output-len`` output
tokens) from this session, once per round after a warm-up round:

- ``alone``, and ``alone again`` at the end;
- ``hogs (caller's session)``: ``--hogs`` busy loops at ``nice -n 19`` (one per core by
  default), started from this session;
- ``hogs (own session)``: the same loops in a session of their own;
- ``1 CPU (taskset)``: every thread of the server's processes moved to one CPU while it
  runs (fewer CPUs than the compute threads it started with), then given back.

Prints each round's output tok/s and TTFT/ITL, and each shared round's ratio to alone
(the better of the two alone rounds). Target: >= 0.5 in every shared round on a
2-core host. Usage::

    python benchmarks/shared_host.py [--streams 16] [--hogs N] [--out FILE] [-- SERVER OPTIONS]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table
from serve import ms, row, server_process

from tokenmill.bench import BenchConfig, run_benchmark

TARGET = 0.5
HOG = "while True: pass"


@contextlib.contextmanager
def hogs(count: int, own_session: bool) -> Iterator[None]:
    """``count`` busy loops at the lowest priority until the block ends, started from this
    session or (``own_session``) together in a new one."""
    loops = " & ".join([f"nice -n 19 {sys.executable} -c '{HOG}'"] * count)
    shell = subprocess.Popen(["sh", "-c", f"{loops} & wait"], start_new_session=own_session)
    try:
        yield
    finally:
        _kill_children(shell.pid)
        shell.wait()


def _kill_children(pid: int) -> None:
    for child in _descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *_descendants(int(child))]
    return found


def _set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` and of its descendants on ``cpus``."""
    for process in (pid, *_descendants(pid)):
        for task in Path(f"/proc/{process}/task").glob("*"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cpus)


@contextlib.contextmanager
def one_cpu(server_pid: int) -> Iterator[None]:
    """The server on one CPU (the first it may use) until the block ends."""
    allowed = os.sched_getaffinity(server_pid)
    _set_affinity(server_pid, {min(allowed)})
    try:
        yield
    finally:
        _set_affinity(server_pid, allowed)


Condition = Callable[[int], contextlib.AbstractContextManager]  # the server's pid -> a round


def rounds(args: argparse.Namespace) -> list[tuple[str, Condition]]:
    def alone(pid: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    return [("warm-up", alone), ("alone", alone),
            ("hogs (caller's session)", lambda pid: hogs(args.hogs, own_session=False)),
            ("hogs (own session)", lambda pid: hogs(args.hogs, own_session=True)),
            ("1 CPU (taskset)", one_cpu),
            ("alone again", alone)]


def measure(args: argparse.Namespace, server_args: list[str]) -> dict:
    results = []
    with server_process(None, server_args, own_session=True) as (base_url, server):
        for seed, (label, condition) in enumerate(rounds(args)):
            config = BenchConfig(base_url=base_url, concurrency=args.streams,
                                 num_requests=args.streams * args.requests_per_stream,
                                 input_len=args.input_len, output_len=args.output_len,
                                 ignore_eos=True, seed=seed)
            with condition(server.pid):
                summary = asyncio.run(run_benchmark(config)).summary
            print(f"  {label}: {summary.output_throughput:.1f} tok/s", flush=True)
            if label != "warm-up":
                results.append(row(summary, round=label))
    alone = max(r["output_tok_s"] for r in results if r["round"].startswith("alone"))
    for r in results:
        r["ratio_to_alone"] = r["output_tok_s"] / alone
    worst = min(r["ratio_to_alone"] for r in results)
    return {"server_args": server_args, "args": vars(args), "cpu_count": os.cpu_count(),
            "rounds": results, "worst_ratio_to_alone": worst, "target": TARGET,
            "meets_target": worst >= TARGET}


def print_table(report: dict) -> None:
    args = report["args"]
    table = Table(title=f"{args['streams']} streams, {args['input_len']} in / "
                        f"{args['output_len']} out; hogs: {args['hogs']} nice-19 busy loops")
    for column in ("round", "output tok/s", "/ alone", "TTFT p50 ms", "ITL p50 ms",
                   "ITL p99 ms"):
        table.add_column(column, justify="right")
    for r in report["rounds"]:
        table.add_row(r["round"], f"{r['output_tok_s']:.1f}", f"{r['ratio_to_alone']:.2f}",
                      ms(r["ttft_p50_ms"]), ms(r["itl_p50_ms"]), ms(r["itl_p99_ms"]))
    Console(width=110).print(table)
    verdict = "ok" if report["meets_target"] else "MISSED"
    print(f"worst shared round / alone: {report['worst_ratio_to_alone']:.2f} "
          f"(target >= {report['target']}: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests-per-stream", type=int, default=1)
    parser.add_argument("--hogs", type=int, default=os.cpu_count())
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/shared_host.json")
    args, server_args = parser.parse_known_args()
    report = measure(args, [a for a in server_args if a != "--"])
    print_table(report)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
