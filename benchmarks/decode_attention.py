"""Decode attention over the paged KV cache: the native kernel against PyTorch's SDPA form,
for a head size and an optional sliding window, side by side in one process.

Each sequence decodes one token over ``--context`` keys (its last ``--window`` with a
window) laid out in shuffled blocks; each figure is the fastest of ``--repeats`` calls
(the least disturbed by other work on a shared machine), per layer. With ``--layers N``
a call goes over N caches in turn, as a decode step goes over a model's layers: with
enough of them the keys and values come from memory rather than cache, and the rate of
reading them (GB/s of keys and values) is what to compare with the host's memory
bandwidth. Ratio = SDPA / native: above 1 means the native kernel is faster. Usage::

    python benchmarks/decode_attention.py [--head-dim 256] [--window 1024] [--dtype bfloat16]
                                          [--layers 30]
"""

from __future__ import annotations

import argparse

import torch
from report_file import write_report  # noqa: E402  (sibling module)
from roofline import best_seconds  # noqa: E402  (sibling module)

from tokenmill.kernels import native_kernels
from tokenmill.models.attention.kv_int8 import quantize_rows
from tokenmill.models.attention.native import NativeDecode
from tokenmill.models.attention.sdpa import SdpaAttention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                        help="auto: the cache in --dtype; int8: 8-bit rows")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=1,
                        help="caches gone over in turn per call (30: SmolLM2's step)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/decode_attention.json")
    args = parser.parse_args()

    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are not available here")
    torch.set_num_threads(args.threads)
    dtype, bs, d = DTYPES[args.dtype], args.block_size, args.head_dim
    blocks_per_seq = -(-args.context // bs)
    num_blocks = args.seqs * blocks_per_seq
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, num_blocks, bs, args.kv_heads, d, generator=gen).to(dtype)
              for _ in range(args.layers)]
    if args.kv_cache_dtype == "int8":
        caches = [quantize_rows(cache) for cache in caches]
    tables = torch.randperm(num_blocks, generator=gen).view(args.seqs, blocks_per_seq)
    q = torch.randn(args.seqs, args.heads, d, generator=gen).to(dtype)
    lens = [args.context] * args.seqs
    native = NativeDecode(kernels, args.window)
    native_plan = native.plan(tables, lens, num_blocks)
    sdpa = SdpaAttention(args.heads, args.kv_heads, d, dtype, window=args.window)
    sdpa_plan = sdpa._plan_decode(tables, lens, bs, num_blocks)
    def every_layer(attend) -> None:
        for cache in caches:
            attend(cache)

    with torch.inference_mode():
        native_s = best_seconds(lambda: every_layer(
            lambda cache: native(q, cache, native_plan, d**-0.5)), args.repeats) / args.layers
        sdpa_s = best_seconds(lambda: every_layer(
            lambda cache: sdpa.decode(q, cache, sdpa_plan, d**-0.5)), args.repeats) / args.layers
    visible = min(args.context, args.window or args.context)
    row_bytes = caches[0].shape[-1] * caches[0].element_size()  # a (token, KV head) row
    kv_bytes = 2 * args.seqs * visible * args.kv_heads * row_bytes
    report = {"args": vars(args), "torch": torch.__version__, "native_us": native_s * 1e6,
              "sdpa_us": sdpa_s * 1e6, "ratio": sdpa_s / native_s,
              "native_kv_gb_s": kv_bytes / native_s / 1e9}
    print(f"{args.seqs} x {args.context} keys (window {args.window}), heads {args.heads}/"
          f"{args.kv_heads} of {d}, {args.dtype} (cache {args.kv_cache_dtype}), "
          f"{args.threads} thread(s), {args.layers} "
          f"layer(s): native {report['native_us']:.0f} us a layer "
          f"({report['native_kv_gb_s']:.1f} GB/s of keys and values), SDPA "
          f"{report['sdpa_us']:.0f} us, ratio {report['ratio']:.2f}")
    write_report(report, args.out)


if __name__ == "__main__":
    main()
