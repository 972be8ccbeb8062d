"""The linear kernels side by side: milliseconds per call of every weight format this host
runs, on the embedded model's projection shapes, at a few row counts.

Each format packs the same random weight; each call multiplies ``rows`` activations of
the format's dtype (the host's ``auto`` dtype, or float32 for the AVX2 w4a8 kernel) by
it. Per shape and row count the table gives each format's median time over ``--repeats``
timed runs of ``--calls`` calls, and its speed against the unquantized native (or oneDNN)
format of the host's dtype. Usage::

    python benchmarks/linear_kernels.py [--rows 1 16 64 256] [--calls 20] [--repeats 5]
                                        [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table

from tokenmill.hardware import cpu_flags
from tokenmill.kernels import native_kernels
from tokenmill.models.weights.quantizations import choose_weight_format, resolve_dtype

CPU = torch.device("cpu")
# (name, out_features, in_features): SmolLM2-135M's projections and its output head
SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("head", 49152, 576))
QUANTIZATIONS = ("none", "int8", "int4", "w4a8", "w8a8")


def formats_here() -> dict[str, tuple[torch.dtype, object]]:
    """Every quantization this host runs, with its activations' dtype and its format."""
    kernels = native_kernels()
    found = {}
    for quantization in QUANTIZATIONS:
        dtype = resolve_dtype("auto", CPU, quantization)
        try:
            found[quantization] = (dtype, choose_weight_format(dtype, CPU, quantization,
                                                               kernels))
        except ValueError:
            continue  # not on this host
    return found


def time_calls(packed, x: torch.Tensor, calls: int, repeats: int) -> float:
    """Median milliseconds per call."""
    packed(x)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            packed(x)
        runs.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/linear_kernels.json")
    args = parser.parse_args()
    formats = formats_here()
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features, generator=gen) * 0.05
        head = name == "head"
        packed = {}
        for quantization, (dtype, fmt) in formats.items():
            if fmt is None:
                continue
            chosen = fmt.head if head else fmt
            packed[quantization] = (dtype, type(chosen).__name__,
                                    chosen.pack(weight.to(dtype), None))
        for rows in args.rows:
            x = torch.randn(rows, in_features, generator=gen)
            times = {q: time_calls(p, x.to(dtype), max(1, args.calls // (10 if head else 1)),
                                   args.repeats)
                     for q, (dtype, _, p) in packed.items()}
            for quantization, (dtype, fmt_name, _) in packed.items():
                results.append({"shape": name, "out_features": out_features,
                                "in_features": in_features, "rows": rows,
                                "quantization": quantization, "format": fmt_name,
                                "dtype": str(dtype).removeprefix("torch."),
                                "ms": times[quantization],
                                "speed_vs_none": times["none"] / times[quantization]})
    table = Table(title="ms per call (speed against none); "
                        + ", ".join(f"{q}: {type(fmt).__name__} in {str(dtype)[6:]}"
                                    for q, (dtype, fmt) in formats.items() if fmt)
                        + " (the head: the format's head format)")
    table.add_column("shape")
    table.add_column("rows", justify="right")
    for quantization in packed:
        table.add_column(quantization, justify="right")
    for name, *_ in SHAPES:
        for rows in args.rows:
            cells = {r["quantization"]: r for r in results
                     if r["shape"] == name and r["rows"] == rows}
            table.add_row(name, str(rows), *(
                f"{cells[q]['ms']:.3f} ({cells[q]['speed_vs_none']:.2f}x)" for q in packed))
    Console(width=160).print(table)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    write_report({"args": vars(args), "cpu_flags": flags, "results": results}, args.out)


if __name__ == "__main__":
    main()
