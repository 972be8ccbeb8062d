"""Prefill attention over the paged KV cache: the native kernel against PyTorch's SDPA
form, side by side in one process, for one long prompt in chunks and for a batch of short
prompts.

A ``--prompt-len`` prompt prefills in ``--chunk``-token chunks, each attending over the
chunks before it (as the scheduler's token budget splits it); ``--short`` prompts of
``--short-len`` tokens prefill together in one call. Keys and values lie in shuffled
blocks. Each figure is one layer's time, the fastest of ``--repeats`` runs. Ratio = SDPA
/ native: above 1 means the native kernel is faster. bfloat16 (the native kernel's dtype;
it needs AVX512-BF16). Usage::

    python benchmarks/prefill_attention.py [--prompt-len 2048] [--chunk 256] [--head-dim 64]
"""

from __future__ import annotations

import argparse

import torch
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table
from roofline import best_seconds  # noqa: E402  (sibling module)

from tokenmill.kernels import native_kernels
from tokenmill.models.attention.metadata import AttentionMetadata
from tokenmill.models.attention.native import NativePrefill
from tokenmill.models.attention.sdpa import SdpaPrefill


class Prefills:
    """Sequences of (context, new tokens) in shuffled blocks of one cache; ``run(prefill)``
    attends every sequence's new tokens with one backend's prefill."""

    def __init__(self, seqs: list[tuple[int, int]], heads: int, kv_heads: int,
                 head_dim: int, block_size: int, gen: torch.Generator) -> None:
        per_seq = [-(-(ctx + n) // block_size) for ctx, n in seqs]
        order = torch.randperm(sum(per_seq), generator=gen)
        self.cache = torch.randn(2, sum(per_seq), block_size, kv_heads, head_dim,
                                 generator=gen).bfloat16()
        tables, slots, starts, first = [], [], [0], 0
        for (ctx, n), count in zip(seqs, per_seq, strict=True):
            table = order[first : first + count].tolist()
            first += count
            tables.append(table + [0] * (max(per_seq) - count))
            slots += [table[p // block_size] * block_size + p % block_size
                      for p in range(ctx, ctx + n)]
            starts.append(starts[-1] + n)
        self.md = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=starts,
            query_lens=[n for _, n in seqs], seq_lens=[ctx + n for ctx, n in seqs],
            block_tables=torch.tensor(tables), block_size=block_size)
        flat = self.cache.view(2, -1, kv_heads, head_dim)
        self.k, self.v = flat[0, self.md.slot_mapping], flat[1, self.md.slot_mapping]
        self.q = torch.randn(len(slots), heads, head_dim, generator=gen).bfloat16()
        self.out = torch.empty(len(slots), heads * head_dim, dtype=torch.bfloat16)
        self.scale = head_dim**-0.5

    def run(self, prefill) -> None:
        plan = prefill.plan(self.md, list(range(len(self.md.query_lens))),
                            self.cache.shape[1])
        prefill(self.q, self.k, self.v, self.cache, plan, self.scale, self.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--short-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/prefill_attention.json")
    args = parser.parse_args()

    kernels = native_kernels()
    if kernels is None or not kernels.capabilities.prefill_attention(torch.bfloat16,
                                                                     args.head_dim):
        raise SystemExit("no native prefill attention here (it needs AVX512-BF16 and a "
                         "head size of 64, 128 or 256)")
    gen = torch.Generator().manual_seed(0)
    shape = (args.heads, args.kv_heads, args.head_dim, args.block_size, gen)
    cases = {
        f"{args.prompt_len} tokens in {args.chunk}-token chunks": [
            Prefills([(ctx, min(args.chunk, args.prompt_len - ctx))], *shape)
            for ctx in range(0, args.prompt_len, args.chunk)],
        f"{args.short} prompts of {args.short_len} tokens": [
            Prefills([(0, args.short_len)] * args.short, *shape)],
    }
    backends = {"native": NativePrefill(kernels, torch.bfloat16, args.head_dim),
                "sdpa": SdpaPrefill(torch.bfloat16)}
    report = {"args": vars(args), "torch": torch.__version__, "cases": {}}
    table = Table(title=f"prefill attention, one layer, heads {args.heads} over "
                        f"{args.kv_heads} of {args.head_dim}, bfloat16 (ms, best of "
                        f"{args.repeats}); ratio = SDPA / native")
    for column in ("case", "native ms", "SDPA ms", "ratio"):
        table.add_column(column, justify="right")
    with torch.inference_mode():
        for name, calls in cases.items():
            ms = {backend: 1e3 * best_seconds(
                      lambda p=prefill, cs=calls: [c.run(p) for c in cs], args.repeats)
                  for backend, prefill in backends.items()}
            report["cases"][name] = {"native_ms": ms["native"], "sdpa_ms": ms["sdpa"],
                                     "ratio": ms["sdpa"] / ms["native"]}
            table.add_row(name, f"{ms['native']:.2f}", f"{ms['sdpa']:.2f}",
                          f"{ms['sdpa'] / ms['native']:.2f}")
    Console().print(table)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
