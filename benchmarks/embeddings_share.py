"""Generation throughput with and without a concurrent embedding load, on one server.

Starts ``tokenmill serve`` (the embedded SmolLM2-135M-Instruct) on a free port, or uses
``--base-url``, and runs, ``--rounds`` times each, alternating:

- **alone**: ``--streams`` concurrent completions of ``--max-tokens`` tokens each
  (``ignore_eos``, temperature 0);
- **shared**: the same, while ``--embed-workers`` clients post ``/v1/embeddings``
  requests (``--embed-batch`` inputs of about 60 tokens each, a new text every request,
  so no prefix-cache hit) back to back until the completions are done.

Generation tok/s = output tokens / wall time of the completions; each mode keeps its
fastest round (the host may be shared). Also reported: the embedded inputs per second
and their tokens per second during the shared rounds.

Usage::

    python benchmarks/embeddings_share.py [--streams 16] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report_file import write_report  # noqa: E402  (sibling module)
from serve import running_server  # noqa: E402  (sibling module)

WORDS = ("river stone lantern orchard copper meadow harbor violet engine signal "
         "quiet canyon amber thread window garden silver market forest ladder").split()


def passage(i: int) -> str:
    """About 60 tokens of text that no other call returns (no prefix-cache hit)."""
    return f"{i}: " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(50))


async def generate(client: httpx.AsyncClient, streams: int, max_tokens: int) -> dict:
    async def one(i: int) -> int:
        r = await client.post("/v1/completions", json={
            "prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(streams))))
    wall = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": wall, "tok_s": tokens / wall}


async def embed_until(client: httpx.AsyncClient, done: asyncio.Event, batch: int,
                      texts: itertools.count) -> tuple[int, int]:
    inputs = tokens = 0
    while not done.is_set():
        r = await client.post("/v1/embeddings", json={
            "input": [passage(next(texts)) for _ in range(batch)]})
        r.raise_for_status()
        inputs += batch
        tokens += r.json()["usage"]["prompt_tokens"]
    return inputs, tokens


async def shared(client: httpx.AsyncClient, args: argparse.Namespace,
                 texts: itertools.count) -> dict:
    done = asyncio.Event()
    workers = [asyncio.create_task(embed_until(client, done, args.embed_batch, texts))
               for _ in range(args.embed_workers)]
    await asyncio.sleep(0.2)  # the embedding load is on before generation starts
    result = await generate(client, args.streams, args.max_tokens)
    done.set()
    counts = await asyncio.gather(*workers)
    result["embedded_inputs_per_s"] = sum(c[0] for c in counts) / result["seconds"]
    result["embedded_tokens_per_s"] = sum(c[1] for c in counts) / result["seconds"]
    return result


async def run(base_url: str, args: argparse.Namespace) -> dict:
    texts = itertools.count()
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await generate(client, 2, 4)  # warm-up
        alone, with_embeddings = [], []
        for _ in range(args.rounds):
            alone.append(await generate(client, args.streams, args.max_tokens))
            with_embeddings.append(await shared(client, args, texts))
    best_alone = max(alone, key=lambda r: r["tok_s"])
    best_shared = max(with_embeddings, key=lambda r: r["tok_s"])
    return {"streams": args.streams, "max_tokens": args.max_tokens,
            "embed_workers": args.embed_workers, "embed_batch": args.embed_batch,
            "alone": best_alone, "shared": best_shared,
            "ratio": best_shared["tok_s"] / best_alone["tok_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an existing server (default: start one)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--embed-workers", type=int, default=2)
    parser.add_argument("--embed-batch", type=int, default=8)
    parser.add_argument("--out", help="write the report as JSON here")
    args, extra = parser.parse_known_args()
    server = (contextlib.nullcontext(args.base_url) if args.base_url
              else running_server(None, extra))
    with server as base_url:
        report = asyncio.run(run(base_url, args))
    print(f"c{report['streams']} generation: {report['alone']['tok_s']:.1f} tok/s alone, "
          f"{report['shared']['tok_s']:.1f} tok/s beside embeddings "
          f"({report['ratio']:.2f}x; {report['shared']['embedded_inputs_per_s']:.1f} "
          f"inputs/s, {report['shared']['embedded_tokens_per_s']:.0f} tokens/s embedded)")
    if args.out:
        write_report(report, args.out)


if __name__ == "__main__":
    main()
