"""``run_benchmark(config) -> BenchResult``: one whole run, from probe to summary.

Steps, in order::

    read the dataset / load --tokenizer   (no network: bad input fails first)
    GET /v1/models                        (reachability; the default model)
    POST /tokenize probe                  (how prompt lengths are measured)
    warm-up request                       (not counted; settles stream_options)
    prompts for a count-bounded run are made before the clock starts
    drive the load                        (loadgen.drive; requests stream into RawResponses)
    count tokens, time them, summarize    (after the run, off the timed event loop)

Setup problems raise ``BenchSetupError``; problems of individual requests never
raise: they are recorded as failed requests.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import time

import aiohttp

from tokenmill.bench.config import BenchConfig, BenchSetupError
from tokenmill.bench.counting import count_record
from tokenmill.bench.loadgen import drive
from tokenmill.bench.progress import RunProgress
from tokenmill.bench.prompts import DatasetPrompts, Prompt, SyntheticPrompts, load_dataset
from tokenmill.bench.records import CountingMethod, RawResponse, Status
from tokenmill.bench.results import BenchResult
from tokenmill.bench.stats import summarize
from tokenmill.bench.stream import (
    REQUEST_ERRORS,
    STREAM_OPTIONS_CHOICES,
    Endpoint,
    error_message,
    send,
)
from tokenmill.bench.tokenizers import (
    LocalTokenCounter,
    ServerTokenCounter,
    TokenCounter,
    WordTokenCounter,
)

CONNECT_TIMEOUT_S = 10.0
PREPARE_PARALLELISM = 8


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run the benchmark ``config`` describes against its server and return the result."""
    entries = load_dataset(config.dataset) if config.dataset else None
    local = LocalTokenCounter(config.tokenizer) if config.tokenizer else None
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with open_client(config.timeout) as client:
        model = await resolve_model(client, config, headers)
        counter: TokenCounter = (
            await ServerTokenCounter.probe(client, config.base_url, model, headers)
            or local or WordTokenCounter())
        prompts = (DatasetPrompts(entries, counter, config.output_len) if entries else
                   SyntheticPrompts(counter, config.input_len, config.output_len,
                                    config.range_ratio, config.seed))
        endpoint = await warm_up(client, config, model, headers, await prompts.warmup())
        ready = await _prepare(prompts, config.num_requests if config.duration is None else 0)
        raws: list[RawResponse] = []
        async with RunProgress(config.progress, config.num_requests, config.duration) as bar:

            async def run_one(index: int) -> None:
                prompt = ready.pop(index, None) or await prompts.get(index)
                raw = RawResponse(index, prompt.max_tokens, prompt.num_tokens)
                raws.append(raw)
                await send(client, endpoint, prompt.text, raw, start_ts)
                bar.request_finished()

            start_ts, start_cpu_s = time.perf_counter(), time.process_time()
            duration_s = await drive(config, run_one, start_ts)
            client_cpu_s = time.process_time() - start_cpu_s
    for raw in raws:
        if raw.status is None:
            raw.status = Status.CUT_OFF
    count_text = local.count_output if local is not None else None
    records = sorted((count_record(raw, count_text) for raw in raws), key=lambda r: r.index)
    summary = summarize(records, duration_s, config.goodput, client_cpu_s)
    info = _info(config, model, counter, endpoint, entries is not None)
    return BenchResult(info, summary, _notes(info, summary.counting_methods), records)


def open_client(timeout_s: float) -> aiohttp.ClientSession:
    """The HTTP client of a run (``async with``): no cap on connections; ``timeout_s`` for
    a connection (at most ``CONNECT_TIMEOUT_S``) and for each read, none for a whole
    response. aiohttp parses HTTP in C: the load generator shares the cores with the
    server it measures, and at a thousand chunks a second its own CPU time shows in the
    server's figures."""
    timeout = aiohttp.ClientTimeout(total=None, connect=min(timeout_s, CONNECT_TIMEOUT_S),
                                    sock_read=timeout_s)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


async def resolve_model(client: aiohttp.ClientSession, config: BenchConfig,
                        headers: dict[str, str]) -> str:
    """``config.model``, or the first model the server lists; checks the server answers."""
    try:
        async with client.get(f"{config.base_url}/v1/models", headers=headers) as resp:
            status, content = resp.status, await resp.read()
    except REQUEST_ERRORS as exc:
        raise BenchSetupError(f"cannot reach the server at {config.base_url}: "
                              f"{type(exc).__name__}: {exc}") from exc
    if config.model:
        return config.model
    if status != 200:
        raise BenchSetupError(f"GET /v1/models answered HTTP {status}: "
                              f"{error_message(content)} (give --model)")
    try:
        return json.loads(content)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchSetupError("GET /v1/models lists no model (give --model)") from exc


async def warm_up(client: aiohttp.ClientSession, config: BenchConfig, model: str,
                  headers: dict[str, str], prompt: Prompt) -> Endpoint:
    """Send the uncounted warm-up request; return the endpoint settings that worked.

    ``stream_options`` are tried in ``STREAM_OPTIONS_CHOICES`` order, moving on only
    when the server rejects the request as invalid (HTTP 400 or 422).
    """
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    error = None
    for options in STREAM_OPTIONS_CHOICES:
        endpoint = Endpoint(f"{config.base_url}{path}", config.endpoint == "chat", model,
                            headers, config.ignore_eos, options, config.temperature,
                            config.logprobs)
        raw = RawResponse(-1, prompt.max_tokens, prompt.num_tokens)
        await send(client, endpoint, prompt.text, raw, time.perf_counter())
        if raw.status is Status.OK:
            return endpoint
        error = raw.error
        if raw.http_status not in (400, 422):
            break
    raise BenchSetupError(f"the warm-up request to {path} failed: {error}")


async def _prepare(prompts: SyntheticPrompts | DatasetPrompts, count: int) -> dict[int, Prompt]:
    """Prompts 0..count-1, made before the run so their making is not timed with it."""
    limit = asyncio.Semaphore(PREPARE_PARALLELISM)

    async def one(index: int) -> Prompt:
        async with limit:
            return await prompts.get(index)

    made = await asyncio.gather(*(one(i) for i in range(count)))
    return dict(enumerate(made))


def _info(config: BenchConfig, model: str, counter: TokenCounter, endpoint: Endpoint,
          from_dataset: bool) -> dict:
    prompts = (f"dataset {config.dataset}" if from_dataset else
               f"synthetic: input {config.input_len}, output {config.output_len} tokens, "
               f"range ratio {config.range_ratio}")
    return {
        "base_url": config.base_url, "model": model, "endpoint": config.endpoint,
        "load": config.describe_load(), "concurrency": config.concurrency,
        "request_rate": config.request_rate, "burstiness": config.burstiness,
        "num_requests": config.num_requests, "duration": config.duration,
        "prompts": prompts, "input_len": config.input_len, "output_len": config.output_len,
        "range_ratio": config.range_ratio, "ignore_eos": config.ignore_eos,
        "temperature": config.temperature, "logprobs": config.logprobs,
        "seed": config.seed, "prompt_length_method": counter.method,
        "stream_options": endpoint.stream_options,
        "output_tokenizer": config.tokenizer is not None,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


def _notes(info: dict, methods: dict[str, int]) -> list[str]:
    notes = []
    if info["prompt_length_method"] == WordTokenCounter.method:
        notes.append("prompt lengths are approximate: the server has no /tokenize and no "
                     "--tokenizer was given, so one word was counted as one token")
    if info["endpoint"] == "chat":
        notes.append("chat: prompt lengths measure the message text; the chat template adds "
                     "tokens, which the server's usage (when sent) includes")
    if info["stream_options"] != STREAM_OPTIONS_CHOICES[0]:
        notes.append(f"the server rejected continuous usage; sent stream_options="
                     f"{info['stream_options']}")
    fallback = {m: n for m, n in methods.items() if m != CountingMethod.CONTINUOUS_USAGE.value}
    explain = {
        CountingMethod.FINAL_USAGE.value: "totals from the final usage chunk, split over "
        "chunks estimated (for TTFT/ITL)",
        CountingMethod.TOKENIZER.value: "the local tokenizer over the received text",
        CountingMethod.CHUNKS.value: "one token per chunk with text (an estimate)",
    }
    for method, num in fallback.items():
        notes.append(f"{num} request(s) had no per-chunk usage; counted by {method}: "
                     f"{explain[method]}")
    return notes
