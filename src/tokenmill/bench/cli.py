"""The ``bench`` command: ``tokenmill bench ...`` and ``tokenmill bench compare A B``.

``register(subparsers)`` adds ``bench`` to the main CLI; ``main(argv)`` serves
``python -m tokenmill.bench``. Either way the parsed namespace has
``func(args) -> int`` (exit code):

- 0: the run finished (some requests may have failed or been cut off);
- 1: every request of the run failed;
- 2: bad arguments, unreadable files, unreachable server, failed warm-up: one line
  ``tokenmill bench: error: ...`` on stderr, no traceback;
- 130: interrupted.

A run prints its report to stdout, then one line ``wrote PATH`` (an absolute path) for
every file it wrote: the ``--result-json`` file and each ``--plot`` PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from rich.console import Console

from tokenmill.bench.config import SLO_KEYS, BenchConfig, BenchConfigError, BenchSetupError
from tokenmill.bench.report import print_comparison, print_report
from tokenmill.bench.results import load_result_json
from tokenmill.bench.runner import run_benchmark

PROG = "tokenmill bench"
T = TypeVar("T")


class UsageError(Exception):
    """A command-line problem reported as one line, exit code 2."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand (and its ``compare`` action) to a main CLI."""
    parser = subparsers.add_parser(
        "bench", help="benchmark any OpenAI-compatible server",
        description="Benchmark an OpenAI-compatible server (see docs/bench.md).")
    add_arguments(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m tokenmill.bench``."""
    parser = argparse.ArgumentParser(prog=PROG, description="Benchmark an OpenAI-compatible "
                                     "server (see docs/bench.md).")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(func=run_command, bench_action=None)
    actions = parser.add_subparsers(dest="bench_action", metavar="{compare}")
    compare = actions.add_parser("compare", help="show two result JSON files side by side")
    compare.add_argument("a", metavar="A.json")
    compare.add_argument("b", metavar="B.json")
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000")
    server.add_argument("--model", help="model name (default: first of GET /v1/models)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    server.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    server.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for a connection or the next chunk")
    load = parser.add_argument_group("load (one of --concurrency / --request-rate)")
    load.add_argument("--concurrency", type=int, help="requests in flight (default 1)")
    load.add_argument("--request-rate", type=float, help="requests/s, gamma arrivals; inf ok")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    load.add_argument("--num-requests", type=int, help="requests to send (default 100 "
                      "unless --duration is given)")
    load.add_argument("--duration", type=float, help="seconds; requests running then are "
                      "cut off")
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--input-len", type=int, default=1024)
    prompts.add_argument("--output-len", type=int, default=128)
    prompts.add_argument("--range-ratio", type=float, default=0.0,
                         help="lengths uniform in len*(1-r)..len*(1+r)")
    prompts.add_argument("--dataset", help="JSONL: prompt, optional max_tokens/output_len")
    prompts.add_argument("--ignore-eos", action="store_true")
    prompts.add_argument("--temperature", type=float, default=None,
                         help="sampling temperature of every request (default: the server's)")
    prompts.add_argument("--logprobs", type=int, default=None, metavar="N",
                         help="ask for the N most likely tokens' log-probabilities at every "
                              "output token (default: none)")
    prompts.add_argument("--seed", type=int, default=0)
    prompts.add_argument("--tokenizer", help="local Hugging Face tokenizer folder")
    out = parser.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                     help="SLOs, KEY in ttft, tpot, e2el")
    out.add_argument("--result-json", help="write every figure and request here")
    out.add_argument("--plot", metavar="DIR", help="write PNG plots here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_command(args: argparse.Namespace) -> int:
    try:
        if args.bench_action == "compare":
            return _compare(args)
        return _bench(args)
    except UsageError as exc:
        message = str(exc)
    except BenchConfigError as exc:
        message = f"--{exc.param.replace('_', '-')} {exc.message}"
    except BenchSetupError as exc:
        message = str(exc)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _bench(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    _check_outputs(args)
    result = asyncio.run(run_benchmark(config))
    data = result.to_json()
    print_report(data, Console())
    written = []
    if args.result_json:
        _write(lambda: result.write_json(args.result_json), args.result_json)
        written.append(args.result_json)
    if args.plot:
        from tokenmill.bench.plots import write_plots  # matplotlib only when asked for

        written.extend(_write(lambda: write_plots(data, args.plot), args.plot))
    for path in written:
        # NOTE: plain print, not rich: a long path must stay on one line to be copied
        print(f"wrote {os.path.abspath(path)}", flush=True)
    summary = data["summary"]
    all_failed = summary["num_failed"] > 0 and summary["num_ok"] + summary["num_cut_off"] == 0
    return 1 if all_failed else 0


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if not args.base_url:
        raise UsageError("--base-url is required (the server to measure, "
                         "e.g. --base-url http://127.0.0.1:8000)")
    return BenchConfig(
        base_url=args.base_url, model=args.model, api_key=args.api_key,
        endpoint=args.endpoint, concurrency=args.concurrency, request_rate=args.request_rate,
        burstiness=args.burstiness, num_requests=args.num_requests, duration=args.duration,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        dataset=args.dataset, ignore_eos=args.ignore_eos, temperature=args.temperature,
        logprobs=args.logprobs, seed=args.seed,
        tokenizer=args.tokenizer, goodput=parse_goodput(args.goodput or []),
        timeout=args.timeout, progress=not args.no_progress)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}``."""
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            slos[key] = float(value)
        except ValueError:
            raise UsageError(f"--goodput takes KEY:MS with KEY in {', '.join(SLO_KEYS)}; "
                             f"got {item!r}") from None
    return slos


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail before the run, not after it, when its outputs cannot be written."""
    if args.result_json:
        folder = os.path.dirname(os.path.abspath(args.result_json))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise UsageError(f"--result-json {args.result_json}: folder {folder} is not "
                             "writable")
    if args.plot and os.path.exists(args.plot) and not os.path.isdir(args.plot):
        raise UsageError(f"--plot {args.plot} exists and is not a folder")


def _write(action: Callable[[], T], path: str) -> T:
    try:
        return action()
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _compare(args: argparse.Namespace) -> int:
    try:
        a, b = load_result_json(args.a), load_result_json(args.b)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    print_comparison(a, b, args.a, args.b, Console())
    return 0
