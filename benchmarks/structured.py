"""Structured outputs on the embedded SmolLM2, through a real server: how often the JSON
is valid, what the grammar costs in throughput, and what it adds to the first token.

Starts ``tokenmill serve`` (the embedded SmolLM2-135M-Instruct) on a free port, or uses
``--base-url``, and measures, in one run:

1. **schema-valid rate**: the fixed suite below, 24 schemas with a prompt each, one chat
   request per case with ``response_format`` json_schema at temperature 0.8 (seeded);
   a case is valid when it finishes with ``stop`` and its content parses and validates
   against its schema (``jsonschema``). Target: 100%. Each schema runs as written and
   bounded (``bounded``: free strings at most 40 characters, arrays at most 5 items,
   numbers in hundredths), as one would write it for a 135M model: as written, the model
   may ramble inside an unbounded string, array or number until ``max_tokens`` (the
   output is then a valid prefix, cut off, and counts as not valid).
2. **output tok/s, constrained vs unconstrained**, at 1 stream and at ``--streams``: the
   same chat prompts, ``--max-tokens`` output tokens each (``ignore_eos`` for the free
   requests; the constrained ones ask for a JSON array of at least 64 strings, so the
   grammar is live at every token and they too run to ``max_tokens``). Output tok/s =
   all output tokens / wall time; the two modes alternate, ``--rounds`` times, and each
   keeps its fastest round (the host may be shared). Target at 16 streams: >= 0.9x.
3. **added time to first token**: the median TTFT of a one-token constrained request
   minus that of the same request unconstrained (same prompt: a prefix-cache hit, so the
   difference is the grammar's), for a schema sent for the first time (uncached: checked
   on the HTTP side, compiled in the engine) and for one the server has seen (cached).
   Target: cached <= 10 ms.

Usage::

    python benchmarks/structured.py [--streams 16] [--max-tokens 64] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import decimal
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import httpx
import jsonschema
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report_file import write_report  # noqa: E402  (sibling module)


def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, \
    {"type": "boolean"}
# (name, schema, prompt): realistic schemas, none bounded for the model's sake
SUITE: list[tuple[str, dict, str]] = [
    ("person", _obj({"name": STR, "age": INT}),
     "Give me a fictional person with a name and an age."),
    ("address", _obj({"street": STR, "city": STR, "postcode": STR, "country": STR}),
     "Write the address of a bakery in Paris."),
    ("product", _obj({"name": STR, "price": NUM, "in_stock": BOOL}),
     "Describe a laptop for sale in an online shop."),
    ("weather", _obj({"city": STR, "temperature_c": NUM,
                      "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]}}),
     "What is the weather like in Oslo today?"),
    ("book", _obj({"title": STR, "author": STR, "year": INT}),
     "Recommend a classic novel."),
    ("movie", _obj({"title": STR, "director": STR, "year": INT,
                    "genres": {"type": "array", "items": STR}}),
     "Tell me about a famous science fiction film."),
    ("todo", _obj({"tasks": {"type": "array", "items": _obj({"title": STR, "done": BOOL})}}),
     "Make a short to-do list for a Saturday morning."),
    ("recipe", _obj({"dish": STR, "servings": INT,
                     "ingredients": {"type": "array", "items": STR}}),
     "Give me a simple pancake recipe."),
    ("event", _obj({"name": STR, "date": {"type": "string", "format": "date"},
                    "location": STR}),
     "Invent a music festival happening next summer."),
    ("sentiment", _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                        "score": {"type": "number", "minimum": 0, "maximum": 1}}),
     "Classify the sentiment of: 'I loved the food but the service was slow.'"),
    ("translation", _obj({"source": STR, "target_language": STR, "translation": STR}),
     "Translate 'good morning' into Spanish."),
    ("contact", _obj({"name": STR, "email": {"type": "string", "format": "email"},
                      "phone": STR}),
     "Create contact details for a plumber."),
    ("order", _obj({"order_id": INT, "items": {"type": "array", "items": _obj(
        {"sku": STR, "quantity": INT})}, "total": NUM}),
     "Write an order of two items from a stationery shop."),
    ("city", _obj({"name": STR, "country": STR, "population": INT, "capital": BOOL}),
     "Tell me about Tokyo."),
    ("animal", _obj({"species": STR, "legs": INT, "habitat": STR, "endangered": BOOL}),
     "Describe an animal that lives in the ocean."),
    ("quiz", _obj({"question": STR, "options": {"type": "array", "items": STR,
                                                "minItems": 2, "maxItems": 4},
                   "answer": STR}),
     "Write a quiz question about the solar system."),
    ("car", _obj({"make": STR, "model": STR, "year": INT,
                  "fuel": {"enum": ["petrol", "diesel", "electric", "hybrid"]}}),
     "Describe a family car."),
    ("meeting", _obj({"title": STR, "attendees": {"type": "array", "items": STR},
                      "duration_minutes": INT}),
     "Plan a short team meeting."),
    ("song", _obj({"title": STR, "artist": STR, "duration_seconds": INT}),
     "Name a popular song."),
    ("country", _obj({"name": STR, "capital": STR, "languages": {"type": "array",
                                                                  "items": STR}}),
     "Tell me about Switzerland."),
    ("invoice", _obj({"number": STR, "customer": _obj({"name": STR, "email": STR}),
                      "amount": NUM, "paid": BOOL}),
     "Create an invoice for a web design job."),
    ("review", _obj({"product": STR, "rating": {"type": "integer", "minimum": 1,
                                                "maximum": 5}, "comment": STR}),
     "Write a review of a coffee machine."),
    ("flight", _obj({"from": STR, "to": STR, "departure": STR, "price_eur": NUM}),
     "Find a flight from Berlin to Rome."),
    ("optional_fields", _obj({"name": STR, "nickname": STR, "age": INT}, required=["name"]),
     "Describe a cartoon character."),
]


def bounded(schema):
    """``schema`` with every free string at most 40 characters, every array at most 5
    items and every number in hundredths, where it does not say otherwise."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    kind = schema.get("type")
    if kind == "string" and not {"enum", "format", "pattern"} & set(schema):
        out.setdefault("maxLength", 40)
    elif kind == "array":
        out.setdefault("maxItems", 5)
    elif kind == "number":
        out.setdefault("multipleOf", 0.01)
    return out


def _multiple_of(validator, step, instance, schema):
    """multipleOf in decimal arithmetic (jsonschema's float division says 8.87 is not a
    multiple of 0.01)."""
    if validator.is_type(instance, "number") and \
            decimal.Decimal(str(instance)) % decimal.Decimal(str(step)) != 0:
        yield jsonschema.ValidationError(f"{instance} is not a multiple of {step}")


Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                         {"multipleOf": _multiple_of})
LIST_SCHEMA = _obj({"items": {"type": "array", "items": STR, "minItems": 64}})
THROUGHPUT_PROMPTS = [
    "List as many fruits as you can.", "List as many animals as you can.",
    "List as many countries as you can.", "List as many colours as you can.",
    "List as many vegetables as you can.", "List as many sports as you can.",
    "List as many musical instruments as you can.", "List as many cities as you can.",
]
USAGE = {"include_usage": True}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not start in 300 s")


async def stream_chat(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed chat request: its text, finish reason, output tokens and TTFT."""
    start = time.perf_counter()
    ttft = None
    text, finish, tokens = [], None, 0
    async with client.stream("POST", "/v1/chat/completions",
                             json={**body, "stream": True, "stream_options": USAGE}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event.get("choices", ()):
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
            if event.get("usage") and not event.get("choices"):
                tokens = event["usage"]["completion_tokens"]
    return {"text": "".join(text), "finish_reason": finish, "tokens": tokens, "ttft": ttft,
            "seconds": time.perf_counter() - start}


def chat_body(prompt: str, max_tokens: int, schema: dict | None = None, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            **extra}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": schema}}
    return body


async def validity(client: httpx.AsyncClient, max_tokens: int, concurrency: int,
                   form: str) -> dict:
    limit = asyncio.Semaphore(concurrency)

    async def case(i: int, name: str, schema: dict, prompt: str) -> dict:
        if form == "bounded":
            schema = bounded(schema)
        async with limit:
            out = await stream_chat(client, chat_body(prompt, max_tokens, schema,
                                                      temperature=0.8, seed=i))
        valid, why = False, "cut off by max_tokens"
        if out["finish_reason"] == "stop":
            try:
                Validator(schema).validate(json.loads(out["text"]))
                valid, why = True, "valid"
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                why = f"INVALID: {str(e).splitlines()[0][:80]}"
        return {"case": name, "valid": valid, "why": why, "tokens": out["tokens"],
                "text": out["text"]}

    cases = await asyncio.gather(*(case(i, *c) for i, c in enumerate(SUITE)))
    return {"cases": list(cases), "valid": sum(c["valid"] for c in cases),
            "cut_off": sum(c["why"].startswith("cut") for c in cases),
            "invalid": sum(c["why"].startswith("INVALID") for c in cases),
            "total": len(cases)}


async def throughput(client: httpx.AsyncClient, streams: int, max_tokens: int,
                     constrained: bool, requests: int) -> dict:
    prompts = [THROUGHPUT_PROMPTS[i % len(THROUGHPUT_PROMPTS)] for i in range(requests)]
    limit = asyncio.Semaphore(streams)

    async def one(i: int, prompt: str) -> dict:
        extra = {"temperature": 0.8, "seed": i}
        body = (chat_body(prompt, max_tokens, LIST_SCHEMA, **extra) if constrained
                else chat_body(prompt, max_tokens, ignore_eos=True, **extra))
        async with limit:
            return await stream_chat(client, body)

    start = time.perf_counter()
    outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    tokens = sum(o["tokens"] for o in outs)
    return {"requests": requests, "output_tokens": tokens, "seconds": elapsed,
            "output_tok_s": tokens / elapsed,
            "finish_reasons": sorted({o["finish_reason"] for o in outs})}


async def added_ttft(client: httpx.AsyncClient, repeats: int) -> dict:
    prompt = "Reply with a JSON object describing a pet."
    base = _obj({"name": STR, "species": STR, "age": INT})
    samples: dict[str, list[float]] = {"free": [], "uncached": [], "cached": []}
    await stream_chat(client, chat_body(prompt, 1))  # the prompt's blocks: cached from here
    await stream_chat(client, chat_body(prompt, 1, base))  # base schema: compiled from here
    run = f"{time.time_ns()}"
    for i in range(repeats):
        fresh = {**base, "properties": {**base["properties"], f"tag_{run}_{i}": STR}}
        for mode, schema in (("free", None), ("uncached", fresh), ("cached", base)):
            out = await stream_chat(client, chat_body(prompt, 1, schema, temperature=0.0))
            samples[mode].append(out["ttft"])
    medians = {mode: statistics.median(values) for mode, values in samples.items()}
    return {"repeats": repeats, "ttft_ms": {m: 1000 * v for m, v in medians.items()},
            "added_ms": {"uncached": 1000 * (medians["uncached"] - medians["free"]),
                         "cached": 1000 * (medians["cached"] - medians["free"])}}


async def run(base_url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await stream_chat(client, chat_body("Hello!", 4))  # warm-up
        results: dict = {"validity": {}}
        for form in ("as written", "bounded"):
            v = await validity(client, args.max_tokens_valid, args.streams, form)
            results["validity"][form] = v
            print(f"schema-valid ({form}): {v['valid']}/{v['total']}", flush=True)
        results["throughput"] = {}
        for streams in (1, args.streams):
            requests = args.requests_single if streams == 1 else 2 * streams
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for mode in ("unconstrained", "constrained"):
                    r = await throughput(client, streams, args.max_tokens,
                                         mode == "constrained", requests)
                    if mode not in best or r["output_tok_s"] > best[mode]["output_tok_s"]:
                        best[mode] = r
            ratio = best["constrained"]["output_tok_s"] / best["unconstrained"]["output_tok_s"]
            results["throughput"][streams] = {**best, "ratio": ratio}
            print(f"{streams} stream(s): constrained/unconstrained {ratio:.2f}", flush=True)
        results["ttft"] = await added_ttft(client, args.ttft_repeats)
        return results


def print_tables(results: dict, args: argparse.Namespace) -> None:
    console = Console()
    forms = results["validity"]
    title = ", ".join(f"{form} {v['valid']}/{v['total']} ({100 * v['valid'] / v['total']:.0f}%)"
                      for form, v in forms.items())
    table = Table(title=f"schema-valid rate at temperature 0.8: {title}")
    table.add_column("case")
    for form in forms:
        table.add_column(form)
        table.add_column("tokens", justify="right")
    for i, (name, _, _) in enumerate(SUITE):
        row = [name]
        for v in forms.values():
            row += [v["cases"][i]["why"], str(v["cases"][i]["tokens"])]
        table.add_row(*row)
    console.print(table)
    table = Table(title=f"output tok/s, {args.max_tokens} tokens per request "
                        f"(best of {args.rounds})")
    for column in ("streams", "unconstrained", "constrained", "ratio"):
        table.add_column(column, justify="right")
    for streams, r in results["throughput"].items():
        table.add_row(str(streams), f"{r['unconstrained']['output_tok_s']:.1f}",
                      f"{r['constrained']['output_tok_s']:.1f}", f"{r['ratio']:.2f}")
    console.print(table)
    t = results["ttft"]
    table = Table(title=f"time to first token, median of {t['repeats']} (ms)")
    for column in ("schema", "TTFT", "added"):
        table.add_column(column, justify="right")
    table.add_row("none", f"{t['ttft_ms']['free']:.1f}", "")
    for mode in ("uncached", "cached"):
        table.add_row(mode, f"{t['ttft_ms'][mode]:.1f}", f"{t['added_ms'][mode]:+.1f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server (default: start one)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="output tokens per throughput request")
    parser.add_argument("--max-tokens-valid", type=int, default=384,
                        help="max_tokens of a schema-valid case")
    parser.add_argument("--requests-single", type=int, default=4,
                        help="requests of the single-stream throughput run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-repeats", type=int, default=15)
    parser.add_argument("--server-args", default="", help="more 'tokenmill serve' flags")
    parser.add_argument("--out", default="benchmarks/results/structured.json")
    args = parser.parse_args()
    server = None
    base_url = args.base_url
    if base_url is None:
        port = free_port()
        server = start_server(port, args.server_args.split())
        base_url = f"http://127.0.0.1:{port}"
    try:
        results = asyncio.run(run(base_url, args))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    print_tables(results, args)
    write_report({"machine": {"cpu": platform.processor() or platform.machine(),
                              "cpus": os.cpu_count()},
                  "settings": vars(args), "results": results}, args.out)


if __name__ == "__main__":
    main()
