"""tokenmill against other servers, side by side in one run, with the host's roofline.

Runs the same streaming load (``--input-len`` prompt tokens, exactly ``--output-len``
output tokens with ``ignore_eos``, ``/v1/completions``, concurrency 1, 4, 16 and 64 by
default) against one or more tokenmill configurations, each started as ``tokenmill
serve`` in turn, and against every peer URL given with ``--peer NAME=URL`` (a server
already running, or started by the script with ``--peer-start NAME=COMMAND`` and stopped
after its run: vLLM, llama.cpp's ``llama-server``, ...), one server at a time, each level
with fresh prompts so nothing comes from a prefix cache.

With ``--rounds N`` every server runs N times, every other round in reverse order, and
each level reports its best round: a shared machine's speed drifts by tens of percent
over minutes, and noise only ever slows a server down. Beside the ratio of the bests, each
level gets the median over the rounds of the ratio within a round (servers that ran
minutes apart, not a whole run apart), the steadier figure when the drift is large.

Prints one table: per server and concurrency, output tok/s, TTFT and ITL p50/p99, the
CPU the load generator itself used (cores' worth: it shares the host with the server),
the ratio of the first tokenmill configuration to each peer, and the fraction of the host's
roofline reached (``roofline.py``: the measured matmul peak and read bandwidth, for
``--roofline-dtype``; quantized weights read fewer bytes, so they can pass 1.0); and,
where one stream was measured, each server's prefill rate (prompt tokens / TTFT p50)
against the host's bfloat16 matmul peak.
Writes everything to JSON. Usage::

    python benchmarks/peers.py --peer vllm=http://127.0.0.1:8001 \\
        [--peer-start vllm='bash PEERS/serve-vllm.sh --dtype float32'] \\
        [--config tokenmill=] [--config int8='--quantization int8'] \\
        [--concurrency 1 4 16 64] [--requests-per-stream 2] [--rounds 1] \\
        [--peer-tokenizer DIR] \\
        [--roofline-dtype float32] [--out FILE]

A configuration is ``NAME=SERVER OPTIONS`` (empty options: the defaults). Peers are
asked with ``--peer-tokenizer`` (a Hugging Face tokenizer folder of the same model)
when they have no ``/tokenize``, so every server gets prompts of the same length.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shlex
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator

import httpx
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table
from roofline import measure_host, serving_bound
from serve import ms, row, running_server

from tokenmill.bench import BenchConfig, run_benchmark
from tokenmill.model_source import default_model_path
from tokenmill.models.gguf.loader import open_gguf

BYTES_PER_WEIGHT = {"float32": 4, "bfloat16": 2}
PEER_START_TIMEOUT_S = 600


def named(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def model_size() -> tuple[int, int]:
    """(parameters of every matmul incl. the LM head, all weights) of the embedded model."""
    cfg, _ = open_gguf(default_model_path())
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    matmuls = cfg.num_hidden_layers * per_layer + cfg.vocab_size * h
    embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return matmuls, matmuls + embedding


@contextlib.contextmanager
def peer_running(url: str, command: str | None) -> Iterator[None]:
    """Start ``command`` (a shell line) in its own process group and wait until ``url``
    answers ``/v1/models``; stop the whole group afterwards. ``None``: already running."""
    if command is None:
        yield
        return
    wait_until_gone(url)  # the server before may still be releasing the port
    with tempfile.TemporaryFile() as log:
        peer = subprocess.Popen(command, shell=True, start_new_session=True, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + PEER_START_TIMEOUT_S
            while True:
                if peer.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode("utf-8", "replace")[-2000:]
                    raise SystemExit(f"the peer did not start ({command}):\n{tail}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url.rstrip("/") + "/v1/models", timeout=2).status_code == 200:
                        break
                time.sleep(1)
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(peer.pid, signal.SIGTERM)
            try:
                peer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(peer.pid, signal.SIGKILL)
                peer.wait()
            wait_until_gone(url)


def wait_until_gone(url: str) -> None:
    """Until nothing answers at ``url`` (at most ``PEER_START_TIMEOUT_S``)."""
    deadline = time.monotonic() + PEER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            httpx.get(url.rstrip("/") + "/v1/models", timeout=2)
        except httpx.TransportError:
            return
        time.sleep(1)
    raise SystemExit(f"a server still answers at {url}")


class Levels:
    """Runs every concurrency level against one server, each with its own prompt seed."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seeds = itertools.count(args.seed)

    def run(self, base_url: str, tokenizer: str | None) -> list[dict]:
        rows = []
        for concurrency in self.args.concurrency:
            config = BenchConfig(
                base_url=base_url, concurrency=concurrency,
                num_requests=concurrency * self.args.requests_per_stream,
                input_len=self.args.input_len, output_len=self.args.output_len,
                ignore_eos=True, seed=next(self.seeds), tokenizer=tokenizer)
            result = asyncio.run(run_benchmark(config))
            rows.append(row(result.summary, concurrency=concurrency))
            print(f"  c{concurrency}: {rows[-1]['output_tok_s']:.1f} tok/s", flush=True)
        return rows


def measure(args: argparse.Namespace) -> dict:
    host = measure_host()
    matmul_params, weights = model_size()
    weight_bytes = weights * BYTES_PER_WEIGHT[args.roofline_dtype]
    bounds = {c: serving_bound(host, matmul_params, weight_bytes, args.roofline_dtype,
                               args.input_len, args.output_len, c) for c in args.concurrency}
    levels = Levels(args)
    commands = dict(args.peer_start)
    servers = [{"name": name, "kind": "tokenmill", "options": options}
               for name, options in args.config or [("tokenmill", "")]]
    servers += [{"name": name, "kind": "peer", "url": url, "command": commands.get(name)}
                for name, url in args.peer]
    rounds: dict[str, list[list[dict]]] = {server["name"]: [] for server in servers}
    for index in range(args.rounds):
        print(f"round {index + 1} of {args.rounds}", flush=True)
        # every other round in reverse order: a drift of the machine's speed during a
        # round then falls on the servers alike
        for server in servers if index % 2 == 0 else servers[::-1]:
            rounds[server["name"]].append(run_server(server, args, levels))
    for server in servers:
        server["rounds"] = rounds[server["name"]]
        server["rows"] = best_rows(server["rounds"])
    reference = {r["concurrency"]: r for r in servers[0]["rows"]}
    for server in servers:
        medians = median_round_ratios(servers[0]["rounds"], server["rounds"])
        for r, median in zip(server["rows"], medians, strict=True):
            r["roofline_tok_s"] = bounds[r["concurrency"]]
            r["roofline_fraction"] = r["output_tok_s"] / bounds[r["concurrency"]]
            r["ratio_reference_to_this"] = (reference[r["concurrency"]]["output_tok_s"]
                                            / r["output_tok_s"] if r["output_tok_s"] else None)
            r["ratio_median_of_rounds"] = median
            # a lone stream's prompt is the only work before its first token
            r["prefill_tok_s"] = (args.input_len / (r["ttft_p50_ms"] / 1000)
                                  if r["concurrency"] == 1 and r["ttft_p50_ms"] else None)
            r["prefill_bf16_peak_fraction"] = (
                r["prefill_tok_s"] * 2 * matmul_params / (host["bfloat16_gflops"] * 1e9)
                if r["prefill_tok_s"] else None)
    return {"host": host, "cpu_count": os.cpu_count(), "model_matmul_params": matmul_params,
            "model_weights": weights, "args": vars(args), "reference": servers[0]["name"],
            "servers": servers}


def run_server(server: dict, args: argparse.Namespace, levels: Levels) -> list[dict]:
    """Every level against ``server``, started for it (and stopped after) if it is
    tokenmill or a peer with a start command."""
    if server["kind"] == "tokenmill":
        print(f"{server['name']}: tokenmill serve {server['options']}", flush=True)
        with running_server(args.model, shlex.split(server["options"])) as base_url:
            return levels.run(base_url, None)
    print(f"{server['name']}: {server['url']}", flush=True)
    with peer_running(server["url"], server["command"]):
        return levels.run(server["url"], args.peer_tokenizer)


def best_rows(rounds: list[list[dict]]) -> list[dict]:
    """Per level, the round with the most output tokens/s (a shared machine's noise only
    ever slows a server down), marked with its round."""
    best = []
    for level in zip(*rounds, strict=True):
        index = max(range(len(level)), key=lambda i: level[i]["output_tok_s"])
        best.append({**level[index], "round": index + 1})
    return best


def median_round_ratios(reference: list[list[dict]], other: list[list[dict]]
                        ) -> list[float | None]:
    """Per level, the median over the rounds of reference / other output tokens/s within
    each round (rounds [levels [row]]); None where a round has no tokens from the other."""
    medians = []
    for level in range(len(reference[0])):
        ratios = [ours[level]["output_tok_s"] / theirs[level]["output_tok_s"]
                  for ours, theirs in zip(reference, other, strict=True)
                  if theirs[level]["output_tok_s"]]
        medians.append(statistics.median(ratios) if len(ratios) == len(reference) else None)
    return medians


def print_table(report: dict) -> None:
    args, host = report["args"], report["host"]
    console = Console(width=140)
    table = Table(title=f"{args['input_len']} in / {args['output_len']} out, streaming, "
                        f"{args['requests_per_stream']} requests per stream, best of "
                        f"{args['rounds']} round(s); ratio = {report['reference']} / server")
    for column in ("server", "streams", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
                   "ITL p50 ms", "ITL p99 ms", "ok", "client CPU", "ratio", "median ratio",
                   "roofline"):
        table.add_column(column, justify="right")
    for server in report["servers"]:
        for index, r in enumerate(server["rows"]):
            last = index == len(server["rows"]) - 1
            table.add_row(server["name"] if index == 0 else "", str(r["concurrency"]),
                          f"{r['output_tok_s']:.1f}", ms(r["ttft_p50_ms"]),
                          ms(r["ttft_p99_ms"]), ms(r["itl_p50_ms"]), ms(r["itl_p99_ms"]),
                          str(r["requests_ok"]), f"{r['client_cpus']:.2f}",
                          f"{r['ratio_reference_to_this']:.2f}"
                          if r["ratio_reference_to_this"] else "-",
                          f"{r['ratio_median_of_rounds']:.2f}"
                          if r["ratio_median_of_rounds"] else "-",
                          f"{r['roofline_fraction']:.0%}", end_section=last)
    console.print(table)
    bounds = ", ".join(f"c{r['concurrency']} {r['roofline_tok_s']:.0f}"
                       for r in report["servers"][0]["rows"])
    for server in report["servers"]:
        lone = next((r for r in server["rows"] if r["prefill_tok_s"]), None)
        if lone is not None:
            console.print(f"{server['name']} prefill (one stream, {args['input_len']} prompt "
                          f"tokens / TTFT p50): {lone['prefill_tok_s']:.0f} tok/s, "
                          f"{lone['prefill_bf16_peak_fraction']:.0%} of the bfloat16 matmul "
                          "peak")
    console.print(f"host ({host['threads']} threads): float32 matmul "
                  f"{host['float32_gflops']:.0f} GFLOP/s, bfloat16 {host['bfloat16_gflops']:.0f} "
                  f"GFLOP/s, reads {host['read_gbps']:.1f} GB/s; roofline in "
                  f"{args['roofline_dtype']} (output tok/s): {bounds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=named, action="append",
                        help="NAME=TOKENMILL SERVE OPTIONS (repeatable; the first is the "
                             "reference of the ratios)")
    parser.add_argument("--peer", type=named, action="append", default=[],
                        help="NAME=URL of a running OpenAI-compatible server (repeatable)")
    parser.add_argument("--peer-start", type=named, action="append", default=[],
                        help="NAME=COMMAND that starts peer NAME (stopped after its run); "
                             "without it the peer must already be running")
    parser.add_argument("--peer-tokenizer", default=None,
                        help="Hugging Face tokenizer folder, for peers without /tokenize")
    parser.add_argument("--model", default=None, help="model for tokenmill (default: embedded)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every server this many times, every other round in reverse "
                             "order, and report each level's best round")
    parser.add_argument("--roofline-dtype", choices=sorted(BYTES_PER_WEIGHT), default="float32")
    parser.add_argument("--seed", type=int, default=0, help="first prompt seed")
    parser.add_argument("--out", default="benchmarks/results/peers.json")
    args = parser.parse_args()
    report = measure(args)
    print_table(report)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
