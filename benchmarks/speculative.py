"""Speculative decoding with prompt-lookup drafts: on vs off, side by side in one run.

Two workloads of chat requests to the embedded SmolLM2 (greedy, ``--max-tokens`` each):

- repetitive: rewrite or quote a given passage, edit a given code snippet (the answer
  repeats much of the prompt, so lookups find drafts);
- ordinary: open questions (little to look up).

Each runs single stream (one request at a time) and at ``--streams`` concurrent
requests, through one engine with ``--speculative-ngram K`` and one without, both in
this process, alternating per workload. Reported per case: output tokens/s (output
tokens / wall time), mean ITL per token (each step committing k tokens after a gap g
gives k samples g/k) and draft acceptance rate (accepted / verified draft tokens); and
the ratio on/off of output tokens/s, and how many greedy outputs are identical. With
``--rounds N`` each case runs N times and keeps its fastest round. Usage::

    python benchmarks/speculative.py [--k 4] [--max-tokens 96] [--streams 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report_file import write_report  # noqa: E402  (sibling module)

from tokenmill import LLM, SamplingParams  # noqa: E402

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. "
    "Every night its keeper climbed the narrow stairs, lit the great lamp and watched the "
    "ships pass safely through the dark water below. When the storm came, the light never "
    "failed, and the sailors who saw it knew that they were close to home."
)
CODE = '''def average(values):
    total = 0
    count = 0
    for value in values:
        total = total + value
        count = count + 1
    if count == 0:
        return 0
    return total / count
'''
REPETITIVE = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this passage, keeping every sentence as it is:\n\n{PASSAGE}",
    f"Rename the function below from average to mean and show the whole code:\n\n{CODE}",
    f"Add a docstring to this Python function and return the complete code:\n\n{CODE}",
]
ORDINARY = [
    "Tell me a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy?",
    "Explain how a computer adds two numbers.",
    "Write a short poem about the sea.",
]


def run_case(llm: LLM, prompts: list[list[int]], streams: int, max_tokens: int) -> dict:
    """Run ``prompts`` ``streams`` at a time; figures from the requests' own stats."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), streams):
        outputs += llm.generate(prompts[i:i + streams], params)
    elapsed = time.perf_counter() - start
    stats = [o.outputs[0].stats for o in outputs]
    tokens = sum(s.num_generation_tokens for s in stats)
    itl = [x for s in stats for x in s.inter_token_latencies]
    drafts = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    return {
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tok_s": tokens / elapsed,
        "itl_ms_mean": 1000.0 * sum(itl) / len(itl) if itl else None,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else None,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="--speculative-ngram of the 'on' engine")
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=4,
                        help="--speculative-disable-by-batch-size of the 'on' engine")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="benchmarks/results/speculative.json")
    args = parser.parse_args()

    engines = {
        "off": LLM(dtype=args.dtype),
        "on": LLM(dtype=args.dtype, speculative_ngram=args.k, ngram_min=args.ngram_min,
                  ngram_max=args.ngram_max,
                  speculative_disable_by_batch_size=args.disable_by_batch_size),
    }
    tokenizer = engines["off"].tokenizer

    def chat(text: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])

    workloads = {"repetitive": [chat(p) for p in REPETITIVE],
                 "ordinary": [chat(p) for p in ORDINARY]}
    for llm in engines.values():  # warm-up
        llm.generate(workloads["ordinary"][:1], SamplingParams(temperature=0.0, max_tokens=4))

    results: dict[str, dict] = {}
    for workload, prompts in workloads.items():
        for streams in (1, args.streams):
            batch = prompts * (args.streams // len(prompts)) if streams > 1 else prompts
            case = f"{workload}, {streams} stream{'s' if streams > 1 else ''}"
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for mode, llm in engines.items():
                    run = run_case(llm, batch, streams, args.max_tokens)
                    if mode not in best or run["output_tok_s"] > best[mode]["output_tok_s"]:
                        best[mode] = run
            same = sum(a == b for a, b in zip(best["off"]["outputs"], best["on"]["outputs"],
                                              strict=True))
            print(f"{case}: on/off {best['on']['output_tok_s'] / best['off']['output_tok_s']:.2f}",
                  flush=True)
            results[case] = {
                "requests": len(batch),
                "identical_outputs": same,
                "speedup": best["on"]["output_tok_s"] / best["off"]["output_tok_s"],
                **{mode: {k: v for k, v in run.items() if k != "outputs"}
                   for mode, run in best.items()},
            }
    print_table(results, args)
    write_report({"machine": {"cpu": platform.processor() or platform.machine(),
                              "cpus": os.cpu_count()},
                  "settings": vars(args), "results": results}, args.out)


def print_table(results: dict, args: argparse.Namespace) -> None:
    table = Table(title=f"speculative decoding, K={args.k}, n-gram {args.ngram_min}..."
                        f"{args.ngram_max}, {args.max_tokens} tokens/request")
    for column in ("case", "off tok/s", "on tok/s", "on/off", "off ITL ms", "on ITL ms",
                   "acceptance", "identical"):
        table.add_column(column, justify="left" if column == "case" else "right")

    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for case, r in results.items():
        off, on = r["off"], r["on"]
        table.add_row(case, num(off["output_tok_s"], ".1f"), num(on["output_tok_s"], ".1f"),
                      num(r["speedup"], ".2f"), num(off["itl_ms_mean"], ".1f"),
                      num(on["itl_ms_mean"], ".1f"), num(on["acceptance_rate"], ".0%"),
                      f"{r['identical_outputs']}/{r['requests']}")
    Console().print(table)


if __name__ == "__main__":
    main()
