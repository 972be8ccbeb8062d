"""Soak: minutes of mixed, hostile load against a real ``tokenmill serve``, then an audit.

Workers send, until ``--duration`` runs out: streams and non-streaming requests with
``n`` of 1 to 3 and ``--min-output`` to ``--output`` tokens per choice, token-id prompts
of ``--min-prompt`` to ``--prompt`` tokens, long enough (with the small
``--num-kv-blocks``) to force preemption, requests the client abandons midway (streams
after a few chunks, non-streaming ones after a random wait), and bad requests
interleaved. Every request asks for ``ignore_eos`` and ``logprobs: 0``, so each token
carries a logprob entry the client counts independently of ``usage``.

The audit, once the server is idle:

- every finished request: ``prompt_tokens`` = its prompt's length, each choice exactly
  ``max_tokens`` tokens (counted from logprobs, and for streams from per-chunk usage),
  ``completion_tokens`` = their sum; every bad request a 4xx with an OpenAI error;
- ``request_success_total``: ``length`` = finished choices, ``abort`` = abandoned ones,
  nothing else; the per-request prompt-length histogram sums the prompts of both;
- ``generation_tokens_total`` = the per-request generation histogram's sum = the
  finished requests' usage + what the abandoned ones generated, which is at least what
  their clients saw; ``prompt_tokens_total`` lies between the finished requests' prompt
  tokens and that plus the abandoned ones';
- gauges at zero, no KV block in use, at least one preemption;
- the server's RSS (its processes together: server and engine) grew less than 5% from
  just after the warm-up to the end: the median of the ``--rss-window`` seconds of
  once-a-second samples that follow the warm-up against the median of the last ones, so
  that one sample caught mid-step (a long prefill's transient buffers) decides nothing.
  The warm-up lasts ``--warmup`` seconds and at least ``--warmup-requests`` requests, so
  that a slow host has also met the load's shapes (prompt lengths, batch sizes, ``n``,
  preemptions) before the baseline; ``--duration`` seconds of load follow it. The
  report also gives each process's own readings (``http``: the server, ``engine``: its
  child processes), taken the same way.

Prints a table and writes JSON (``passed`` says whether every check held; ``rss_mib``
has the samples, each as seconds, http and engine MiB); exit status 1 if any failed.
Usage::

    python benchmarks/soak.py [--model PATH] [--duration 1200] [--warmup 60]
                              [--warmup-requests 300] [--rss-window 15]
                              [--concurrency 8] [--num-kv-blocks 64] [--max-model-len 512]
                              [--min-prompt 16] [--prompt 300] [--min-output 1]
                              [--output 48] [--request-timeout 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table
from serve import free_port, wait_ready  # noqa: E402  (sibling module)

BAD_REQUESTS = [
    {"prompt": "hi", "temperature": -1},
    {"prompt": [1, 2, 10**9]},
    {"prompt": "hi", "n": 0},
    {"prompt": "hi", "top_k": -5},
    {"prompt": "hi", "stop": [""]},
    {"messages": []},
    {"prompt": "hi", "max_tokens": 10**6},
    {"prompt": "hi", "stream": "yes"},
]


@dataclass
class Abandoned:
    """A request the client gave up on, by the ``x-request-id`` it sent."""

    request_id: str
    n: int
    prompt_len: int
    max_tokens: int
    tokens_seen: int = 0  # what its client received before leaving


@dataclass
class Tally:
    """What the clients saw, summed over the run."""

    requests: int = 0
    finished_choices: int = 0
    finished_prompt_tokens: int = 0  # per choice, as the engine counts them
    finished_completion_tokens: int = 0
    aborted_requests: int = 0  # requests with at least one choice aborted
    aborted_choices: int = 0
    aborted_prompt_tokens: int = 0  # per choice
    aborted_tokens_seen: int = 0
    # requests the client gave up on: the server's log tells how each choice ended
    # (see ``settle``)
    abandoned_requests: list[Abandoned] = field(default_factory=list)
    bad_requests: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(message)

    def settle(self, server_log: str) -> None:
        """Count the requests the client gave up on, from the server's log: a choice the
        server logged as ended by ``abort`` after the client left was aborted; every other
        choice of an admitted request finished (``max_tokens``, as ``ignore_eos`` asks: the
        engine got there before it noticed); a request never admitted counts nowhere."""
        for gone in self.abandoned_requests:
            if f"request {gone.request_id}:" not in server_log:
                continue
            aborted = sum(f"request {gone.request_id}: client disconnected; choice {i} "
                          f"ended: abort" in server_log for i in range(gone.n))
            if aborted:
                self.aborted_requests += 1
                self.aborted_choices += aborted
                self.aborted_prompt_tokens += gone.prompt_len * aborted
                self.aborted_tokens_seen += gone.tokens_seen
            self.finished_choices += gone.n - aborted
            self.finished_prompt_tokens += gone.prompt_len * (gone.n - aborted)
            self.finished_completion_tokens += gone.max_tokens * (gone.n - aborted)
        self.abandoned_requests.clear()


def _token_count(choice: dict) -> int:
    logprobs = choice.get("logprobs")
    return len(logprobs["tokens"]) if logprobs else 0


async def stream_request(client: httpx.AsyncClient, body: dict, abort_after: int | None,
                         tally: Tally) -> None:
    n, prompt_len, max_tokens = body["n"], len(body["prompt"]), body["max_tokens"]
    counted = [0] * n
    usage_seen = [0] * n
    final_usage = None
    chunks = 0
    request_id = f"stream-{uuid.uuid4().hex}"
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"x-request-id": request_id}) as r:
        if r.status_code != 200:
            tally.fail(f"stream: HTTP {r.status_code} {await r.aread()!r}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                tally.fail(f"stream error event: {chunk['error']}")
                return
            if not chunk["choices"]:
                final_usage = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            i = choice["index"]
            counted[i] += _token_count(choice)
            usage_seen[i] = chunk["usage"]["completion_tokens"]
            if usage_seen[i] != counted[i]:
                tally.fail(f"stream: usage {usage_seen[i]} != {counted[i]} tokens received")
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                tally.abandoned_requests.append(
                    Abandoned(request_id, n, prompt_len, max_tokens, sum(counted)))
                return  # leaving the block closes the connection
    _check_finished(tally, counted, final_usage, prompt_len, max_tokens, n, "stream")


async def plain_request(client: httpx.AsyncClient, body: dict, abort_after_s: float | None,
                        tally: Tally) -> None:
    """Abandoned (``abort_after_s`` set) when no answer came by then; one that came first
    is a finished request like any other (a fast server finishes short ones in time)."""
    n, prompt_len, max_tokens = body["n"], len(body["prompt"]), body["max_tokens"]
    request_id = f"plain-{uuid.uuid4().hex}"
    try:
        r = await asyncio.wait_for(client.post("/v1/completions", json=body,
                                               headers={"x-request-id": request_id}),
                                   abort_after_s)
    except asyncio.TimeoutError:
        tally.abandoned_requests.append(Abandoned(request_id, n, prompt_len, max_tokens))
        return
    if r.status_code != 200:
        tally.fail(f"plain: HTTP {r.status_code} {r.text[:200]}")
        return
    result = r.json()
    counted = [0] * n
    for choice in result["choices"]:
        counted[choice["index"]] = _token_count(choice)
    _check_finished(tally, counted, result["usage"], prompt_len, max_tokens, n, "plain")


def _check_finished(tally: Tally, counted: list[int], usage: dict | None, prompt_len: int,
                    max_tokens: int, n: int, kind: str) -> None:
    if usage is None:
        tally.fail(f"{kind}: no usage")
        return
    if counted != [max_tokens] * n:
        tally.fail(f"{kind}: choices got {counted} tokens, expected {max_tokens} each")
    if usage["completion_tokens"] != sum(counted) or usage["prompt_tokens"] != prompt_len:
        tally.fail(f"{kind}: usage {usage} for {counted} tokens and a {prompt_len}-token prompt")
    tally.finished_choices += n
    tally.finished_prompt_tokens += prompt_len * n
    tally.finished_completion_tokens += sum(counted)


async def bad_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = rng.choice(BAD_REQUESTS)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = await client.post(path, json=body)
    error = r.json().get("error", {}) if r.headers.get("content-type") == "application/json" \
        else {}
    if not (400 <= r.status_code < 500 and {"message", "type", "param", "code"} <= set(error)):
        tally.fail(f"bad request {body}: HTTP {r.status_code} {r.text[:200]}")
    tally.bad_requests += 1


async def worker(base_url: str, seed: int, stop: asyncio.Event, args, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout) as client:
        while not stop.is_set():
            tally.requests += 1
            kind = rng.random()
            if kind < 0.1:
                await bad_request(client, rng, tally)
                continue
            length = rng.randint(args.min_prompt, args.prompt)
            prompt = [rng.randrange(10, args.vocab) for _ in range(length)]
            aborting = rng.random() < 0.15
            room = args.max_model_len - len(prompt)
            body = {"prompt": prompt, "n": 1 if aborting else rng.choice((1, 1, 2, 3)),
                    "max_tokens": room if aborting else rng.randint(args.min_output, args.output),
                    "ignore_eos": True, "logprobs": 0, "temperature": rng.choice((0.0, 0.8))}
            if kind < 0.6:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
                await stream_request(client, body, rng.randint(1, 3) if aborting else None,
                                     tally)
            else:
                await plain_request(client, body, rng.uniform(0.05, 0.3) if aborting else None,
                                    tally)


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_idle(base_url: str, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base_url)
        if (m["tokenmill_num_requests_running"] == m["tokenmill_num_requests_waiting"]
                == m["tokenmill_kv_cache_tokens_used"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def rss_bytes(pid: int) -> tuple[int, int]:
    """Resident memory of ``pid`` (the HTTP server) and of its child processes together
    (the engine process among them)."""
    return process_rss(pid), sum(process_rss(child) for child in child_pids(pid))


def process_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


@dataclass
class RssTrace:
    """The server's RSS once a second, as (seconds into the load, (http bytes, engine
    bytes)), and when the warm-up ended. A reading's ``part`` picks what it sums: ``None``
    both processes, 0 the http one, 1 the engine."""

    samples: list[tuple[float, tuple[int, int]]] = field(default_factory=list)
    warm: float = 0.0

    def after_warmup(self, window: float, part: int | None = None) -> int:
        """Median of the samples in the ``window`` seconds after the warm-up."""
        return self._median(part, lambda t: self.warm <= t < self.warm + window)

    def at_end(self, window: float, part: int | None = None) -> int:
        """Median of the samples in the last ``window`` seconds."""
        end = self.samples[-1][0]
        return self._median(part, lambda t: t > end - window)

    def _median(self, part: int | None, within) -> int:
        return int(statistics.median(sum(v) if part is None else v[part]
                                     for t, v in self.samples if within(t)))


def audit(tally: Tally, m: dict[str, float], rss_warm: int, rss_end: int) -> dict[str, bool]:
    success = "tokenmill_request_success_total{finished_reason=%s}"
    generated = m["tokenmill_generation_tokens_total"]
    aborted_generated = generated - tally.finished_completion_tokens
    return {
        "every finished request's usage exact, every bad request a 4xx": not tally.errors,
        "finished choices = success{length}": m[success % "length"] == tally.finished_choices,
        "abandoned choices = success{abort}": m[success % "abort"] == tally.aborted_choices,
        "no other finish (stop, error)": m[success % "stop"] == m[success % "error"] == 0,
        "prompt histogram sum = prompts of all choices": (
            m["tokenmill_request_prompt_tokens_sum"]
            == tally.finished_prompt_tokens + tally.aborted_prompt_tokens),
        "generation counter = per-request generation sum": (
            generated == m["tokenmill_request_generation_tokens_sum"]),
        "generation counter covers what every client saw": (
            aborted_generated >= tally.aborted_tokens_seen),
        "prompt counter within finished .. finished + abandoned": (
            tally.finished_prompt_tokens <= m["tokenmill_prompt_tokens_total"]
            <= tally.finished_prompt_tokens + tally.aborted_prompt_tokens),
        "gauges at zero": all(m[g] == 0 for g in (
            "tokenmill_num_requests_running", "tokenmill_num_requests_waiting",
            "tokenmill_kv_cache_tokens_used", "tokenmill_kv_cache_usage_ratio",
            "tokenmill_num_tokens_waiting", "tokenmill_num_tokens_waiting_raw")),
        "preemption happened": m["tokenmill_num_preemptions_total"] > 0,
        "RSS grew < 5% after warm-up": rss_end < rss_warm * 1.05,
    }


async def drive(base_url: str, pid: int, args) -> tuple[Tally, RssTrace]:
    """Load until ``--duration`` seconds after the warm-up, sampling RSS once a second."""
    tally, trace, stop = Tally(), RssTrace(), asyncio.Event()
    start = time.monotonic()
    workers = [asyncio.create_task(worker(base_url, args.seed + i, stop, args, tally))
               for i in range(args.concurrency)]
    warm = None
    while warm is None or trace.samples[-1][0] < warm + args.duration:
        await asyncio.sleep(1.0)
        trace.samples.append((time.monotonic() - start, rss_bytes(pid)))
        if warm is None and trace.samples[-1][0] >= args.warmup \
                and tally.requests >= args.warmup_requests:
            warm = trace.warm = trace.samples[-1][0]
    stop.set()
    await asyncio.gather(*workers)
    return tally, trace


def rss_reading(warm: int, end: int) -> dict[str, float]:
    """Two RSS medians in MiB and the growth between them in %."""
    return {"after_warmup": round(warm / 2**20, 1), "end": round(end / 2**20, 1),
            "growth_pct": round(100 * (end / warm - 1), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--duration", type=float, default=1200.0,
                        help="seconds of load after the warm-up")
    parser.add_argument("--warmup", type=float, default=60.0,
                        help="seconds of load before the RSS baseline")
    parser.add_argument("--warmup-requests", type=int, default=300,
                        help="requests sent before the RSS baseline (the warm-up lasts "
                             "until both --warmup and this are reached)")
    parser.add_argument("--rss-window", type=float, default=15.0,
                        help="seconds of RSS samples whose median is a reading")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--min-prompt", type=int, default=16,
                        help="shortest prompt (tokens)")
    parser.add_argument("--prompt", type=int, default=300, help="longest prompt (tokens)")
    parser.add_argument("--min-output", type=int, default=1,
                        help="fewest tokens per finished choice")
    parser.add_argument("--output", type=int, default=48, help="most tokens per choice")
    parser.add_argument("--vocab", type=int, default=250, help="prompt token ids below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a client waits for a response or the next chunk (a "
                             "whole non-streaming answer on a loaded host can take longer)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "soak.json"))
    args = parser.parse_args()
    if not 1 <= args.min_prompt <= args.prompt < args.max_model_len:
        parser.error("need 1 <= --min-prompt <= --prompt < --max-model-len")
    if not 1 <= args.min_output <= args.output:
        parser.error("need 1 <= --min-output <= --output")

    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "--log-level", "info", "serve",
               *([args.model] if args.model else []), "--port", str(port), "--dtype", "float32",
               "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len",
               str(args.max_model_len), "--block-size", "16"]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = wait_ready(server, f"http://127.0.0.1:{port}", log)
            began = time.monotonic()
            tally, trace = asyncio.run(drive(base_url, server.pid, args))
            elapsed = time.monotonic() - began
            metrics = wait_idle(base_url)
        finally:
            server.terminate()
            server.wait(timeout=60)
        log.seek(0)
        tally.settle(log.read().decode("utf-8", "replace"))
    rss_warm, rss_end = trace.after_warmup(args.rss_window), trace.at_end(args.rss_window)
    checks = audit(tally, metrics, rss_warm, rss_end)
    report = {
        "duration_s": round(elapsed, 1), "concurrency": args.concurrency,
        "tally": {k: v for k, v in vars(tally).items() if k != "errors"},
        "errors": tally.errors,
        "metrics": {k: metrics[k] for k in (
            "tokenmill_generation_tokens_total", "tokenmill_prompt_tokens_total",
            "tokenmill_num_preemptions_total",
            "tokenmill_request_success_total{finished_reason=length}",
            "tokenmill_request_success_total{finished_reason=abort}")},
        "rss_mib": {**rss_reading(rss_warm, rss_end),
                    **{name: rss_reading(trace.after_warmup(args.rss_window, part),
                                         trace.at_end(args.rss_window, part))
                       for part, name in enumerate(("http", "engine"))},
                    "warmup_s": round(trace.warm, 1),
                    "samples": [(round(t, 1), *(round(b / 2**20, 1) for b in v))
                                for t, v in trace.samples]},
        "checks": checks, "passed": all(checks.values()),
    }
    table = Table(title=f"soak: {elapsed:.0f} s, {tally.requests} requests "
                        f"({tally.aborted_requests} abandoned, {tally.bad_requests} bad)")
    table.add_column("check")
    table.add_column("held")
    for name, held in checks.items():
        table.add_row(name, "yes" if held else "NO")
    console = Console()
    console.print(table)
    rss = report["rss_mib"]
    console.print(f"RSS {rss['after_warmup']} -> {rss['end']} MiB ({rss['growth_pct']:+}%, "
                  f"warm-up {rss['warmup_s']} s); preemptions "
                  f"{metrics['tokenmill_num_preemptions_total']:.0f}")
    for name in ("http", "engine"):
        console.print(f"  {name}: {rss[name]['after_warmup']} -> {rss[name]['end']} MiB "
                      f"({rss[name]['growth_pct']:+}%)")
    for error in tally.errors:
        console.print(f"[red]{error}[/red]")
    write_report(report, args.out)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
