"""What a dtype, ``--quantization`` or an 8-bit KV cache costs in accuracy, against float32
on the same weights.

For each configuration (``float32``, the reference; ``bfloat16``; ``int8`` and ``int4``
weights with the activations ``--dtype auto`` gives them, as ``tokenmill serve`` does:
bfloat16 where the CPU computes it, float32 elsewhere; ``w4a8``, int4 weights times int8
activations, in float32, where its kernel runs; ``gguf``, a GGUF file's own blocks, where
the model is one and the native kernels take that dtype; ``kv-int8``, ``--dtype auto``
with ``--kv-cache-dtype int8``; bfloat16 only where the CPU computes it)
it measures, on the embedded model unless ``--model`` (every engine option but ``--dtype``,
``--quantization`` and ``--kv-cache-dtype``, which the configurations set, applies to all
of them):

- on a fixed public-domain text (``tests/data/public_domain.txt``), one prefill through
  the engine's own forward pass: the perplexity and its change against float32, the mean
  KL divergence of every next-token distribution from float32's (less noisy than the
  perplexity change on a short text: that one can come out negative), and how often the
  most likely next token is float32's;
- greedy agreement on a fixed prompt set (chat-templated questions, ``--max-tokens``
  greedy tokens each, through ``LLM.generate``): how many outputs equal float32's token
  for token, and the mean fraction of tokens before the first difference.

Prints one table and writes JSON. Usage::

    python benchmarks/accuracy.py [--model PATH] [--max-tokens 48] [--out FILE]
                                  [ENGINE OPTIONS, as tokenmill generate takes them]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os

import torch
from offline import common_prefix  # noqa: E402  (sibling module)
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.hardware import cpu_has_bf16
from tokenmill.kernels import native_kernels
from tokenmill.models.perplexity import mean_kl_divergence, next_token_logprobs, perplexity_of
from tokenmill.models.weights.formats import GGUFFormat
from tokenmill.models.weights.quantizations import resolve_dtype
from tokenmill.options import add_options, options_from

CPU = torch.device("cpu")
TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                    "data", "public_domain.txt")
CONFIGS = {"float32": {"dtype": "float32", "quantization": "none"},
           "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
           "int8": {"dtype": "auto", "quantization": "int8"},
           "int4": {"dtype": "auto", "quantization": "int4"},
           "w4a8": {"dtype": "auto", "quantization": "w4a8"},
           "w8a8": {"dtype": "auto", "quantization": "w8a8"},
           "gguf": {"dtype": "auto", "quantization": "gguf"},
           "kv-int8": {"dtype": "auto", "kv_cache_dtype": "int8"}}
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "List three uses of a paperclip.", "Explain photosynthesis in one sentence.",
    "What is 17 times 3?", "Name the planets of the solar system.",
    "Write a Python function that reverses a string.", "Who wrote Romeo and Juliet?",
    "Give me a recipe for pancakes.", "Translate 'good morning' into Spanish.",
    "What causes the seasons on Earth?", "Summarize the plot of Cinderella.",
]


def measure_config(base: EngineConfig, options: dict, max_tokens: int) -> dict:
    config = dataclasses.replace(base, **options)
    llm = LLM(**dataclasses.asdict(config))
    with open(TEXT, encoding="utf-8") as f:
        text_ids = llm.tokenizer.encode(f.read())
    model_module = llm.client.core.executor.model
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    logprobs = next_token_logprobs(model_module, text_ids,
                                   kv_int8=config.kv_cache_dtype == "int8")
    result = {"perplexity": perplexity_of(logprobs, text_ids), "text_tokens": len(text_ids),
              "logprobs": logprobs, "outputs": [list(o.outputs[0].token_ids) for o in outputs]}
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default="benchmarks/results/accuracy.json")
    add_options(parser.add_argument_group("engine"), EngineConfig,
                skip=("dtype", "quantization", "kv_cache_dtype"))
    parser.set_defaults(max_num_seqs=len(QUESTIONS))
    args = parser.parse_args()
    base = options_from(args, EngineConfig)
    kernels = native_kernels()
    vnni = kernels is not None and kernels.capabilities.vnni_linear
    skipped = {"w4a8": not vnni and (kernels is None or not kernels.capabilities.w4a8_linear),
               "w8a8": not vnni,  # AVX512-VNNI
               "bfloat16": not cpu_has_bf16(),  # emulated: minutes per configuration
               "gguf": (base.model is not None and os.path.isdir(base.model))  # a GGUF file
               or not GGUFFormat.supports(resolve_dtype("auto", CPU), kernels)}
    configs = {name: options for name, options in CONFIGS.items() if not skipped.get(name)}
    results = {name: measure_config(base, options, args.max_tokens)
               for name, options in configs.items()}
    reference = results["float32"]
    for r in results.values():
        r["perplexity_change"] = r["perplexity"] / reference["perplexity"] - 1
        r["kl_divergence"] = mean_kl_divergence(reference["logprobs"], r["logprobs"])
        r["top1_agreement"] = (r["logprobs"].argmax(-1)
                               == reference["logprobs"].argmax(-1)).float().mean().item()
        pairs = list(zip(r["outputs"], reference["outputs"], strict=True))
        r["identical_outputs"] = sum(a == b for a, b in pairs)
        r["mean_common_prefix"] = sum(common_prefix(a, b) / max(len(b), 1)
                                      for a, b in pairs) / len(pairs)
    table = Table(title=f"accuracy against float32: {len(QUESTIONS)} prompts x "
                        f"{args.max_tokens} greedy tokens; perplexity on "
                        f"{reference['text_tokens']} tokens of fixed text")
    for column in ("config", "perplexity", "change", "KL (nats)", "same top token",
                   "identical outputs", "common prefix"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        table.add_row(name, f"{r['perplexity']:.3f}", f"{r['perplexity_change']:+.2%}",
                      f"{r['kl_divergence']:.4f}", f"{r['top1_agreement']:.1%}",
                      f"{r['identical_outputs']}/{len(QUESTIONS)}",
                      f"{r['mean_common_prefix']:.0%}")
    Console(width=110).print(table)
    for r in results.values():
        del r["logprobs"]  # [tokens, vocabulary]: too large for the report
    write_report({"args": vars(args), "configs": configs, "results": results}, args.out)


if __name__ == "__main__":
    main()
