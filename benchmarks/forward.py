"""Forward-pass speed of tokenmill's model vs Hugging Face transformers, side by side.

Measures, with the same weights and dtype in both:

- prefill: tokens/s of one forward over a ``--prompt-len`` prompt (logits of its last token);
- decode: tokens/s of ``--decode-steps`` greedy steps after that prompt, each one forward of
  one token against the KV cache (tokenmill: the paged cache; transformers: its own cache);
- the same for ``--streams`` sequences decoding together (equal prompt lengths, so that
  transformers needs no padding).

Each figure is the median over ``--repeats`` runs after one warm-up run. Prints a table and
writes JSON (``--out``). Usage::

    python benchmarks/forward.py [--model PATH] [--dtype auto] [--kernels auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from report_file import write_report  # noqa: E402  (sibling module)
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tokenmill.config import KERNEL_CHOICES
from tokenmill.hardware import DTYPE_CHOICES, pick_device
from tokenmill.kernels import choose_kernels
from tokenmill.model_source import default_model_path, model_name_for
from tokenmill.models.attention.metadata import AttentionMetadata
from tokenmill.models.loader import load_model
from tokenmill.models.weights.quantizations import resolve_dtype

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


class PagedBatch:
    """tokenmill's forward for ``num_seqs`` equal-length sequences over a fresh cache;
    sequence ``i`` owns blocks ``i * nb .. (i + 1) * nb - 1``, in order."""

    def __init__(self, model, num_seqs: int, max_tokens: int, dtype, device):
        blocks_per_seq = -(-max_tokens // BLOCK_SIZE)
        shape = model.kv_cache_shape(num_seqs * blocks_per_seq, BLOCK_SIZE)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device)
            for _ in range(model.config.num_hidden_layers)
        ]
        self.block_tables = torch.arange(num_seqs * blocks_per_seq, device=device).view(
            num_seqs, blocks_per_seq
        )
        self.seq_base = [i * blocks_per_seq * BLOCK_SIZE for i in range(num_seqs)]
        self.model = model
        self.device = device

    def step(self, chunks: list[list[int]], start: int) -> torch.Tensor:
        """Forward each sequence's ``chunks[i]`` at positions ``start...``; greedy tokens."""
        n = len(chunks[0])
        positions = list(range(start, start + n))
        md = AttentionMetadata(
            slot_mapping=torch.tensor(
                [base + p for base in self.seq_base for p in positions], device=self.device
            ),
            query_start_loc=[i * n for i in range(len(chunks) + 1)],
            query_lens=[n] * len(chunks),
            seq_lens=[start + n] * len(chunks),
            block_tables=self.block_tables,
            block_size=BLOCK_SIZE,
        )
        ids = torch.tensor([t for chunk in chunks for t in chunk], device=self.device)
        hidden = self.model(ids, torch.tensor(positions * len(chunks), device=self.device),
                            md, self.kv_caches)
        return self.model.compute_logits(hidden[n - 1 :: n]).argmax(-1)


def run_tokenmill(model, prompts, steps, dtype, device) -> tuple[float, float]:
    batch = PagedBatch(model, len(prompts), len(prompts[0]) + steps, dtype, device)
    t0 = time.perf_counter()
    tokens = batch.step(prompts, 0).tolist()
    t1 = time.perf_counter()
    for i in range(steps):
        tokens = batch.step([[t] for t in tokens], len(prompts[0]) + i).tolist()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def run_transformers(model, prompts, steps, device) -> tuple[float, float]:
    ids = torch.tensor(prompts, device=device)
    t0 = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    tokens = out.logits[:, -1].argmax(-1).tolist()
    t1 = time.perf_counter()
    cache = out.cache
    for _ in range(steps):
        step_ids = torch.tensor(tokens, device=device).view(-1, 1)
        out = model(step_ids, cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
        tokens = out.logits[:, -1].argmax(-1).tolist()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def measure(run, repeats: int) -> tuple[float, float]:
    """Median (prefill seconds, decode seconds) over ``repeats`` runs after a warm-up."""
    run()  # warm-up: kernel selection, allocator
    times = [run() for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def compare(ours, theirs, prompts, steps, dtype, device, repeats) -> dict:
    """Both implementations on the same prompts; tokens/s, and tokenmill / transformers."""
    result = {}
    for name, run in (
        ("tokenmill", lambda: run_tokenmill(ours, prompts, steps, dtype, device)),
        ("transformers", lambda: run_transformers(theirs, prompts, steps, device)),
    ):
        prefill_s, decode_s = measure(run, repeats)
        result[name] = {
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "prefill_tok_s": len(prompts) * len(prompts[0]) / prefill_s,
            "decode_tok_s": len(prompts) * steps / decode_s,
        }
    for key in ("prefill_tok_s", "decode_tok_s"):
        result[f"ratio_{key}"] = result["tokenmill"][key] / result["transformers"][key]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--kernels", default="auto", choices=KERNEL_CHOICES,
                        help="tokenmill's kernels, as `tokenmill serve --kernels`")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-prompt-len", type=int, default=128)
    parser.add_argument("--stream-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/forward.json")
    args = parser.parse_args()

    device = pick_device()
    dtype = resolve_dtype(args.dtype, device)
    path = args.model or default_model_path()
    ours, config = load_model(path, dtype, device, kernels=choose_kernels(args.kernels, device))
    theirs = load_reference(path, dtype, device)
    gen = torch.Generator().manual_seed(0)

    def prompts(num: int, length: int) -> list[list[int]]:
        return torch.randint(10, config.vocab_size, (num, length), generator=gen).tolist()

    with torch.inference_mode():
        single = compare(ours, theirs, prompts(1, args.prompt_len), args.decode_steps,
                         dtype, device, args.repeats)
        streams = compare(ours, theirs, prompts(args.streams, args.stream_prompt_len),
                          args.stream_steps, dtype, device, args.repeats)
    report = {
        "model": model_name_for(args.model),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "args": vars(args),
        "single_stream": single,
        "multi_stream": streams,
    }
    print_table(report)
    write_report(report, args.out)


def print_table(report: dict) -> None:
    args = report["args"]
    print(f"{report['model']}  {report['dtype']}  {report['device']}  threads={report['threads']}")
    print(f"{'metric':<40}{'tokenmill':>11}{'transformers':>14}{'ratio':>8}")
    rows = (
        (f"prefill tok/s (1 x {args['prompt_len']})", report["single_stream"], "prefill_tok_s"),
        (f"decode tok/s (1 stream, {args['decode_steps']} steps)",
         report["single_stream"], "decode_tok_s"),
        (f"prefill tok/s ({args['streams']} x {args['stream_prompt_len']})",
         report["multi_stream"], "prefill_tok_s"),
        (f"decode tok/s ({args['streams']} streams, {args['stream_steps']} steps)",
         report["multi_stream"], "decode_tok_s"),
    )
    for label, result, key in rows:
        ours, theirs = result["tokenmill"][key], result["transformers"][key]
        print(f"{label:<40}{ours:>11.1f}{theirs:>14.1f}{result['ratio_' + key]:>7.2f}x")


if __name__ == "__main__":
    main()
