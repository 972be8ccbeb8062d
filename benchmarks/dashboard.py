"""What an open dashboard costs the server: throughput with the page open vs without.

One ``tokenmill serve`` (embedded SmolLM2 unless ``--model``) under ``--streams``
streaming clients (``tokenmill bench``: ``--input-len``-token prompts, exactly
``--output-len`` output tokens), measured with each viewer in turn:

- ``none``: nobody looks at the page;
- ``poll``: a client that requests what the open dashboard requests, as often
  (``/v1/engine/state?since=...`` and ``/v1/requests/recent?limit=40`` every second):
  the server's side of the cost alone;
- ``browser``: the page itself, open on the dashboard in headless Chromium (Debian's
  ``chromium`` + ``chromium-driver``, driven by Selenium) on the same machine, so its
  rendering competes with the server for the CPU too: an upper bound. Skipped, with a
  note, when no browser is installed.

The viewers take turns ``--rounds`` times (their order rotating from round to round),
each measurement short and with a fresh prompt seed. A shared machine's load drifts
over minutes, so each round compares neighbours: the round's ratio is output tok/s with
the viewer / with none in that round, and the result is the median of those ratios
(the best round of each viewer is shown too). The target is >= 0.97. Prints a table and
writes JSON. Usage::

    python benchmarks/dashboard.py [--model PATH] [--streams 16] [--input-len 64]
                                   [--output-len 64] [--requests-per-stream 1]
                                   [--rounds 6] [--out FILE] [-- SERVER OPTIONS]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator

import httpx
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table
from serve import running_server  # noqa: E402  (sibling module)

from tokenmill.bench import BenchConfig, run_benchmark

TARGET = 0.97
POLL_S = 1.0  # the page's poll interval (app.js POLL_MS)
TIMELINE_LIMIT = 40  # app.js TIMELINE_LIMIT


@contextlib.contextmanager
def polling(base_url: str) -> Iterator[dict]:
    """The dashboard's requests, once a second, on a thread; yields a count of them."""
    stats = {"requests": 0}
    stop = threading.Event()

    def loop() -> None:
        since = None
        with httpx.Client(base_url=base_url, timeout=30) as client:
            while not stop.is_set():
                params = {} if since is None else {"since": since}
                samples = client.get("/v1/engine/state", params=params).json()["samples"]
                since = samples[-1][0] if samples else since
                client.get("/v1/requests/recent", params={"limit": TIMELINE_LIMIT})
                stats["requests"] += 2
                stop.wait(POLL_S)

    thread = threading.Thread(target=loop, name="dashboard-poller")
    thread.start()
    try:
        yield stats
    finally:
        stop.set()
        thread.join()


class Browser:
    """One headless Chromium for all rounds; it shows the dashboard only while asked to."""

    def __init__(self) -> None:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "e2e"))
        from browser import find_browser, start_browser

        self.driver = start_browser() if find_browser() else None

    @contextlib.contextmanager
    def showing(self, base_url: str) -> Iterator[dict]:
        self.driver.get(base_url + "/ui#dashboard")
        time.sleep(2 * POLL_S)  # loaded and polling
        try:
            yield {}
        finally:
            self.driver.get("about:blank")

    def close(self) -> None:
        if self.driver is not None:
            self.driver.quit()


def measure(args: argparse.Namespace, server_args: list[str]) -> dict:
    seeds = itertools.count(args.seed)
    browser = Browser()
    viewers = ["none", "poll"] + (["browser"] if browser.driver else [])
    rounds: dict[str, list[dict]] = {v: [] for v in viewers}
    try:
        with running_server(args.model, server_args) as base_url:
            for round_index in range(args.rounds):
                shift = round_index % len(viewers)
                for viewer in viewers[shift:] + viewers[:shift]:
                    if viewer == "none":
                        watching = contextlib.nullcontext({})
                    elif viewer == "poll":
                        watching = polling(base_url)
                    else:
                        watching = browser.showing(base_url)
                    config = BenchConfig(
                        base_url=base_url, concurrency=args.streams,
                        num_requests=args.streams * args.requests_per_stream,
                        input_len=args.input_len, output_len=args.output_len,
                        ignore_eos=True, seed=next(seeds))
                    with watching as watched:
                        summary = asyncio.run(run_benchmark(config)).summary
                    assert summary.num_failed == 0, f"{summary.num_failed} requests failed"
                    rounds[viewer].append({
                        "output_tok_s": summary.output_throughput,
                        "duration_s": summary.duration_s,
                        "dashboard_requests": watched.get("requests")})
    finally:
        browser.close()
    best = {v: max(rs, key=lambda r: r["output_tok_s"]) for v, rs in rounds.items()}
    paired = {v: sorted(r["output_tok_s"] / n["output_tok_s"]
                        for r, n in zip(rs, rounds["none"], strict=True))
              for v, rs in rounds.items()}
    return {
        "model": args.model or "embedded SmolLM2-135M-Instruct", "server_args": server_args,
        "cpu_count": os.cpu_count(), "args": vars(args), "target": TARGET,
        "browser": "headless Chromium" if browser.driver else "not installed: not measured",
        "viewers": {v: {"best": best[v], "round_ratios": paired[v],
                        "ratio_output_tok_s": statistics.median(paired[v]),
                        "rounds": rounds[v]} for v in viewers},
    }


def print_table(report: dict) -> None:
    table = Table(title=f"Dashboard cost: {report['args']['streams']} streams, "
                        f"{report['args']['rounds']} rounds")
    for column in ("viewer", "best output tok/s", "median ratio vs none", "round ratios",
                   "target", "dashboard req/s"):
        table.add_column(column, justify="right")
    for viewer, result in report["viewers"].items():
        best = result["best"]
        polls = best["dashboard_requests"]
        table.add_row(viewer, f"{best['output_tok_s']:.1f}",
                      f"{result['ratio_output_tok_s']:.3f}",
                      " ".join(f"{r:.2f}" for r in result["round_ratios"]),
                      "" if viewer == "none" else f">= {TARGET}",
                      "-" if polls is None else f"{polls / best['duration_s']:.2f}")
    console = Console()
    console.print(table)
    if "browser" not in report["viewers"]:
        console.print("browser: no headless Chromium installed, not measured")


def main() -> None:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "dashboard.json"))
    args = parser.parse_args(argv)
    report = measure(args, server_args)
    print_table(report)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
