"""The host's roofline: matmul peak and memory bandwidth, and the serving bound they imply.

``measure_host()`` times a large square matmul (float32 and bfloat16) and a large
streaming read on all the threads torch uses; ``serving_bound()`` turns those into the
most output tokens/s any server could reach on a streaming workload of ``input_len``
prompt tokens and ``output_len`` output tokens per request at ``concurrency`` streams:

- compute: each output token costs ``2 * P * (input_len + output_len) / output_len``
  FLOPs (``P`` = the parameters of the model's matmuls, LM head included; every prompt
  token goes through them once, and prompt work is shared out over the output tokens);
- memory: one decode step reads every weight once and yields ``concurrency`` tokens, so
  tokens/s <= bandwidth * concurrency / weight bytes.

The bound is the smaller of the two. Attention and the KV cache are left out (a few
percent of both at these lengths), so the bound is slightly optimistic.
"""

from __future__ import annotations

import time

import torch

MATMUL_SIZE = 2048
MATMUL_SECONDS = 0.5
READ_BYTES = 1 << 30


def best_seconds(fn, repeats: int = 5) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn`` (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(dtype: torch.dtype) -> float:
    """GFLOP/s of a square matmul, as large as ``MATMUL_SIZE`` where one takes at most
    ``MATMUL_SECONDS`` (a dtype the CPU only emulates, bfloat16 on AVX2, is measured on a
    smaller one: at 2048 a single product would take a minute)."""
    size = MATMUL_SIZE
    probe = _gflops(256, dtype)
    while size > 256 and 2 * size**3 / (probe * 1e9) > MATMUL_SECONDS:
        size //= 2
    return _gflops(size, dtype)


def _gflops(size: int, dtype: torch.dtype) -> float:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / best_seconds(lambda: torch.mm(a, b)) / 1e9


def read_gbps() -> float:
    """GB/s of a sum over 1 GiB of float32: one streaming read, nothing written."""
    data = torch.ones(READ_BYTES // 4)
    return READ_BYTES / best_seconds(lambda: data.sum()) / 1e9


def measure_host() -> dict:
    return {"threads": torch.get_num_threads(),
            "float32_gflops": matmul_gflops(torch.float32),
            "bfloat16_gflops": matmul_gflops(torch.bfloat16),
            "read_gbps": read_gbps()}


def serving_bound(host: dict, matmul_params: int, weight_bytes: int, dtype: str,
                  input_len: int, output_len: int, concurrency: int) -> float:
    """Output tokens/s no server can pass on this host (see the module docstring)."""
    flops_per_token = 2 * matmul_params * (input_len + output_len) / output_len
    compute = host[f"{dtype}_gflops"] * 1e9 / flops_per_token
    memory = host["read_gbps"] * 1e9 * concurrency / weight_bytes
    return min(compute, memory)
