"""Forward-pass speed of tokenmill's model vs Hugging Face transformers, side by side.

Measures, for one sequence and the same weights and dtype in both:

- prefill: tokens/s of one forward over a ``--prompt-len`` prompt (logits of its last token);
- decode: tokens/s of ``--decode-steps`` greedy steps after that prompt, each one forward of
  one token against the KV cache (tokenmill: the paged cache; transformers: its own cache).

Each figure is the median over ``--repeats`` runs after one warm-up run. Prints a table and
writes JSON (``--out``). Usage::

    python benchmarks/forward.py [--model PATH] [--dtype bfloat16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tokenmill.models.attention_metadata import AttentionMetadata
from tokenmill.models.loader import default_model_path, load_model, model_name_for
from tokenmill.platform import DTYPE_CHOICES, pick_device, resolve_dtype

BLOCK_SIZE = 16


def load_reference(path: str, dtype: torch.dtype, device: torch.device):
    """transformers' model for the same weights: a HF folder, or the GGUF it dequantizes."""
    if os.path.isdir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    folder, name = os.path.split(path)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(folder, gguf_file=name))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.to(dtype=dtype, device=device).eval()


class OneSequence:
    """tokenmill's forward for a single sequence over blocks 0, 1, 2, ... of a fresh cache."""

    def __init__(self, model, max_tokens: int, dtype: torch.dtype, device: torch.device):
        num_blocks = -(-max_tokens // BLOCK_SIZE)
        shape = model.kv_cache_shape(num_blocks, BLOCK_SIZE)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device)
            for _ in range(model.config.num_hidden_layers)
        ]
        self.block_table = torch.arange(num_blocks, device=device).unsqueeze(0)
        self.model = model
        self.device = device

    def step(self, token_ids: list[int], start: int) -> int:
        """Forward ``token_ids`` at positions ``start...``; returns the greedy next token."""
        n = len(token_ids)
        positions = torch.arange(start, start + n, device=self.device)
        md = AttentionMetadata(
            slot_mapping=positions,  # blocks are in order, so slot == position
            query_start_loc=[0, n],
            query_lens=[n],
            seq_lens=[start + n],
            block_tables=self.block_table,
            block_size=BLOCK_SIZE,
        )
        ids = torch.tensor(token_ids, device=self.device)
        hidden = self.model(ids, positions, md, self.kv_caches)
        return int(self.model.compute_logits(hidden[-1:]).argmax())


def run_tokenmill(model, prompt, steps, dtype, device) -> tuple[float, float]:
    seq = OneSequence(model, len(prompt) + steps, dtype, device)
    t0 = time.perf_counter()
    token = seq.step(prompt, 0)
    t1 = time.perf_counter()
    for i in range(steps):
        token = seq.step([token], len(prompt) + i)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def run_transformers(model, prompt, steps, device) -> tuple[float, float]:
    ids = torch.tensor([prompt], device=device)
    t0 = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    token = out.logits[0, -1].argmax()
    t1 = time.perf_counter()
    cache = out.cache
    for _ in range(steps):
        out = model(token.view(1, 1), cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
        token = out.logits[0, -1].argmax()
    int(token)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def measure(run, repeats: int) -> dict[str, float]:
    run()  # warm-up: kernel selection, allocator
    times = [run() for _ in range(repeats)]
    return {
        "prefill_s": statistics.median(t[0] for t in times),
        "decode_s": statistics.median(t[1] for t in times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/forward.json")
    args = parser.parse_args()

    device = pick_device()
    dtype = resolve_dtype(args.dtype, device)
    path = args.model or default_model_path()
    ours, config = load_model(path, dtype, device)
    theirs = load_reference(path, dtype, device)
    prompt = torch.randint(
        10, config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    steps = args.decode_steps
    with torch.inference_mode():
        results = {
            "tokenmill": measure(lambda: run_tokenmill(ours, prompt, steps, dtype, device),
                                 args.repeats),
            "transformers": measure(lambda: run_transformers(theirs, prompt, steps, device),
                                    args.repeats),
        }
    for r in results.values():
        r["prefill_tok_s"] = args.prompt_len / r["prefill_s"]
        r["decode_tok_s"] = steps / r["decode_s"]
    report = {
        "model": model_name_for(args.model),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "prompt_len": args.prompt_len,
        "decode_steps": steps,
        "repeats": args.repeats,
        "results": results,
        "ratio_prefill": results["tokenmill"]["prefill_tok_s"]
        / results["transformers"]["prefill_tok_s"],
        "ratio_decode": results["tokenmill"]["decode_tok_s"]
        / results["transformers"]["decode_tok_s"],
    }
    print_table(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


def print_table(report: dict) -> None:
    ours, theirs = report["results"]["tokenmill"], report["results"]["transformers"]
    print(
        f"{report['model']}  {report['dtype']}  {report['device']}  "
        f"threads={report['threads']}  prompt={report['prompt_len']}  "
        f"decode steps={report['decode_steps']}"
    )
    print(f"{'metric':<22}{'tokenmill':>12}{'transformers':>14}{'ratio':>8}")
    for key, label, ratio in (
        ("prefill_tok_s", "prefill tokens/s", report["ratio_prefill"]),
        ("decode_tok_s", "decode tokens/s", report["ratio_decode"]),
    ):
        print(f"{label:<22}{ours[key]:>12.1f}{theirs[key]:>14.1f}{ratio:>7.2f}x")


if __name__ == "__main__":
    main()
