"""Offline throughput: ``LLM.generate`` vs Hugging Face transformers' batched ``generate``.

Both run the same requests in the same process, with the same weights, dtype and
threads: ``--num-requests`` prompts of ``--input-len`` random token ids, each asking
for exactly ``--output-len`` greedy tokens (tokenmill: ``ignore_eos``; transformers:
``min_new_tokens = max_new_tokens``).

- tokenmill: every prompt is submitted at once and batched continuously, at most
  ``--max-num-seqs`` requests per step and ``--max-num-batched-tokens`` tokens;
- transformers: ``model.generate`` over consecutive batches of ``--hf-batch-size``
  prompts (equal lengths, so no padding; the attention mask is passed explicitly).

Output tokens/s = output tokens of all requests / wall time of the whole workload,
after one small untimed warm-up call each. With ``--rounds N`` both run N times,
alternating, and each keeps its fastest round (the machine is shared; the best round
is the least disturbed one). Also reported: how many leading greedy tokens the two
agree on (bf16 kernels differ, so long outputs may drift apart). Prints a table and
writes JSON. Usage::

    python benchmarks/offline.py [--num-requests 256] [--max-num-seqs 64]
                                 [--hf-batch-size 64] [--rounds 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from forward import load_reference  # noqa: E402  (the sibling benchmark's loader)
from report_file import write_report  # noqa: E402  (sibling module)

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.hardware import pick_device  # noqa: E402
from tokenmill.model_source import default_model_path, model_name_for  # noqa: E402
from tokenmill.models.weights.quantizations import resolve_dtype  # noqa: E402
from tokenmill.options import add_options, options_from  # noqa: E402

WARMUP_TOKENS = 4


def make_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab_size, (num, length), generator=gen).tolist()


def run_tokenmill(llm: LLM, prompts: list[list[int]], output_len: int
                  ) -> tuple[float, list[list[int]]]:
    """Seconds for the whole workload, and each request's output tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, [list(o.outputs[0].token_ids) for o in outputs]


def run_transformers(model, prompts: list[list[int]], output_len: int, batch_size: int,
                     device: torch.device) -> tuple[float, list[list[int]]]:
    """Seconds for the whole workload in batches of ``batch_size``, and the output tokens."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[i:i + batch_size], device=device)
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=output_len, min_new_tokens=output_len,
            pad_token_id=model.config.eos_token_id)
        outputs += generated[:, ids.shape[1]:].tolist()
    return time.perf_counter() - start, outputs


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def measure(args: argparse.Namespace) -> dict:
    config = options_from(args, EngineConfig)
    device = pick_device()
    dtype = resolve_dtype(config.dtype, device, config.quantization)
    config = dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))
    llm = LLM(**dataclasses.asdict(config))
    reference = load_reference(config.model or default_model_path(), dtype, device)
    vocab = llm.client.info.vocab_size
    prompts = make_prompts(args.num_requests, args.input_len, vocab, config.seed)
    with torch.inference_mode():
        run_tokenmill(llm, prompts[:2], WARMUP_TOKENS)
        run_transformers(reference, prompts[:2], WARMUP_TOKENS, 2, device)
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(run_tokenmill(llm, prompts, args.output_len))
            theirs.append(run_transformers(reference, prompts, args.output_len,
                                           args.hf_batch_size, device))
    results = {}
    for name, runs in (("tokenmill", ours), ("transformers", theirs)):
        seconds, tokens = min(runs, key=lambda run: run[0])
        num_tokens = sum(len(t) for t in tokens)
        results[name] = {"seconds": seconds, "output_tokens": num_tokens,
                         "output_tok_s": num_tokens / seconds,
                         "round_seconds": [run[0] for run in runs]}
    agree = [common_prefix(a, b) for a, b in zip(ours[0][1], theirs[0][1], strict=True)]
    return {
        "model": model_name_for(config.model),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "args": {**vars(args), **dataclasses.asdict(config)},
        **results,
        "ratio_output_tok_s": (results["tokenmill"]["output_tok_s"]
                               / results["transformers"]["output_tok_s"]),
        "agreement": {"identical_outputs": sum(a == args.output_len for a in agree),
                      "median_common_prefix": statistics.median(agree)},
    }


def print_table(report: dict) -> None:
    args = report["args"]
    title = (f"offline, {args['num_requests']} requests x {args['input_len']} in / "
             f"{args['output_len']} out, {report['model']} {report['dtype']} "
             f"{report['device']} threads={report['threads']}")
    table = Table(title=title)
    for column in ("engine", "setting", "output tokens", "seconds", "output tok/s"):
        table.add_column(column, justify="right")
    settings = {
        "tokenmill": f"seqs {args['max_num_seqs']}, "
                     f"budget {args['max_num_batched_tokens']}",
        "transformers": f"batch {args['hf_batch_size']}",
    }
    for name in ("tokenmill", "transformers"):
        row = report[name]
        table.add_row(name, settings[name], str(row["output_tokens"]), f"{row['seconds']:.1f}",
                      f"{row['output_tok_s']:.1f}")
    console = Console(width=120)
    console.print(table)
    agreement = report["agreement"]
    console.print(f"ratio tokenmill / transformers (output tok/s): "
                  f"{report['ratio_output_tok_s']:.2f}x   "
                  f"(identical greedy outputs: {agreement['identical_outputs']}/"
                  f"{args['num_requests']}, median common prefix "
                  f"{agreement['median_common_prefix']:g} tokens)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/offline.json")
    add_options(parser.add_argument_group("engine (--seed also seeds the prompts)"), EngineConfig)
    parser.set_defaults(max_num_batched_tokens=512)
    args = parser.parse_args()
    report = measure(args)
    print_table(report)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
