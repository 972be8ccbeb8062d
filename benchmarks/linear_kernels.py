"""The linear kernels side by side: milliseconds per call of every weight format this host
runs, on a model's projection shapes, at a few row counts.

Each format packs the same random weight; each call multiplies ``rows`` activations of
the format's dtype (the host's ``auto`` dtype, or float32 for the AVX2 w4a8 kernel) by
it. With ``--gguf`` the columns are instead ``none`` and ``--quantization gguf``'s kernels
over random valid blocks of a GGUF file's Q4_K, Q6_K and Q8_0 types, each by both of its
routes: the weight-only int4 and int8-group kernels (``wo``, a host without AVX512-VNNI)
and the integer ones over int8 activations (``int``, a VNNI host). With ``--dense`` (a VNNI
host) the columns are ``none`` and, per type, the integer route's two paths over the same
packed weight in bfloat16: its integer kernel (``int``) and the bfloat16 matmul over the
weight dequantized at the call (``dense``, ``DenseAtRowsWeight.dense_product``: what
``DENSE_ROWS`` rows and more take on an AMX host); the head is left out. Per shape and row count
the table gives each column's median time over ``--repeats`` timed runs of ``--calls``
calls, and its speed against ``none``.

``--shapes``: SmolLM2-135M's projections (``smollm2``) or Llama-3.2-1B's (``llama1b``),
each with its output head. ``--layers N`` packs N distinct copies of a layer's four
projections and times them in a decode step's order, layer after layer, so that a stack
larger than the cache streams from memory (the head: one copy). ``--threads``: the
kernels' threads (default: PyTorch's). Usage::

    python benchmarks/linear_kernels.py [--shapes smollm2|llama1b] [--gguf | --dense] [--layers 1]
                                        [--rows 1 16 64 256] [--calls 20] [--repeats 5]
                                        [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table

from tokenmill.hardware import cpu_flags
from tokenmill.kernels import native_kernels
from tokenmill.models.gguf.blocks import FileRows
from tokenmill.models.weights.formats import GGUFFormat
from tokenmill.models.weights.native_weights import DenseAtRowsWeight, KernelWeight
from tokenmill.models.weights.quantizations import choose_weight_format, resolve_dtype

CPU = torch.device("cpu")
# (name, out_features, in_features) of each model's projections and its output head
SHAPES = {
    "smollm2": (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                ("down", 576, 1536), ("head", 49152, 576)),
    "llama1b": (("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048),
                ("down", 2048, 8192), ("head", 128256, 2048)),
}
QUANTIZATIONS = ("none", "int8", "int4", "w4a8", "w8a8")
GGUF_TYPES = (Q.Q4_K, Q.Q6_K, Q.Q8_0)
F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,)}  # byte offsets of d (and dmin)
Packer = Callable[[int, int, torch.Generator], object]  # (out, in) -> a packed weight


def formats_here() -> dict[str, tuple[torch.dtype, Packer]]:
    """Every quantization this host runs: its activations' dtype and how it packs a random
    weight of a shape (a head shape in the format's head format)."""
    kernels = native_kernels()
    found = {}
    for quantization in QUANTIZATIONS:
        dtype = resolve_dtype("auto", CPU, quantization)
        try:
            fmt = choose_weight_format(dtype, CPU, quantization, kernels)
        except ValueError:
            continue  # not on this host
        if fmt is not None:
            found[quantization] = (dtype, dense_packer(fmt, dtype))
    return found


def dense_packer(fmt, dtype: torch.dtype) -> Packer:
    def pack(out_features: int, in_features: int, gen: torch.Generator, head: bool = False):
        weight = torch.randn(out_features, in_features, generator=gen) * 0.05
        return (fmt.head if head else fmt).pack(weight.to(dtype), None)
    return pack


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> FileRows:
    """``[rows, cols]`` of ``qtype``: random bytes with the float16 scales up to 1e-3."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        values = rng.uniform(-1e-3, 1e-3, (data.shape[0], 1)).astype(np.float16)
        data[:, offset:offset + 2] = values.view(np.uint8)
    return FileRows(qtype, data.reshape(rows, -1), cols)


def gguf_formats_here() -> dict[str, tuple[torch.dtype, Packer]]:
    """``none`` and, per type of ``GGUF_TYPES``, ``--quantization gguf``'s weight-only
    route and (on a VNNI host) its integer one, in the host's ``auto`` dtype."""
    kernels = native_kernels()
    dtype = resolve_dtype("auto", CPU, "none")
    dense = choose_weight_format(dtype, CPU, "none", kernels)
    found = {"none": (dtype, dense_packer(dense, dtype))}
    routes = {"wo": GGUFFormat(kernels, dense, integer=False)}
    integer = GGUFFormat.build(dtype, kernels, dense)
    if integer.integer:
        routes["int"] = integer
    for qtype in GGUF_TYPES:
        for route, fmt in routes.items():
            found[f"{qtype.name} {route}"] = (dtype, gguf_packer(fmt, qtype, dtype))
    return found


def gguf_packer(fmt: GGUFFormat, qtype: Q, dtype: torch.dtype) -> Packer:
    def pack(out_features: int, in_features: int, gen: torch.Generator, head: bool = False):
        rng = np.random.default_rng(int(torch.randint(1 << 30, (1,), generator=gen)))
        rows = random_blocks(qtype, out_features, in_features, rng)
        return fmt.pack_rows(torch.empty(1, dtype=dtype).expand(out_features, in_features),
                             None, [rows])
    return pack


def dense_formats_here() -> dict[str, tuple[torch.dtype, Packer]]:
    """``none`` and, per type of ``GGUF_TYPES``, the two paths of ``--quantization gguf``'s
    integer route in bfloat16: the VNNI kernel (``int``) and the matmul over the weight
    dequantized at each call (``dense``)."""
    kernels = native_kernels()
    dtype = torch.bfloat16
    dense = choose_weight_format(dtype, CPU, "none", kernels)
    integer = GGUFFormat.build(dtype, kernels, dense)
    if not integer.integer:
        raise SystemExit("--dense needs the VNNI kernels (AVX512-VNNI)")
    found = {"none": (dtype, dense_packer(dense, dtype))}
    for qtype in GGUF_TYPES:
        pack = gguf_packer(integer, qtype, dtype)
        found[f"{qtype.name} int"] = (dtype, path_packer(pack, KernelWeight.__call__))
        found[f"{qtype.name} dense"] = (dtype, path_packer(pack, DenseAtRowsWeight.dense_product))
    return found


def path_packer(pack: Packer, path: Callable) -> Packer:
    """``pack``'s weights, each called by ``path(weight, x)``."""
    def pack_path(out_features: int, in_features: int, gen: torch.Generator,
                  head: bool = False):
        return functools.partial(path, pack(out_features, in_features, gen, head))
    return pack_path


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


def time_stack(layers: list[dict[str, object]], inputs: dict[str, torch.Tensor],
               repeats: int) -> dict[str, float]:
    """Median milliseconds per call of each projection, called layer after layer in a
    decode step's order (each layer's weights distinct), over ``repeats`` passes."""
    for name, packed in layers[0].items():  # warm up the code, not the weights
        packed(inputs[name])
    runs = {name: [] for name in layers[0]}
    for _ in range(repeats):
        spent = dict.fromkeys(layers[0], 0.0)
        for layer in layers:
            for name, packed in layer.items():
                start = time.perf_counter()
                packed(inputs[name])
                spent[name] += time.perf_counter() - start
        for name, seconds in spent.items():
            runs[name].append(seconds / len(layers) * 1e3)
    return {name: statistics.median(values) for name, values in runs.items()}


def measure(name: str, dtype: torch.dtype, pack: Packer, shapes, args) -> dict:
    """``{(shape, rows): ms}`` of one column: the head alone, the layer's projections one
    layer (``time_calls``) or ``args.layers`` distinct ones (``time_stack``)."""
    gen = torch.Generator().manual_seed(0)
    times = {}
    for shape, out_features, in_features in shapes:
        if shape != "head":
            continue
        packed = pack(out_features, in_features, gen, head=True)
        for rows in args.rows:
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            times[shape, rows] = time_calls(packed, x, max(1, args.calls // 10), args.repeats)
        del packed
        gc.collect()
    layer_shapes = [s for s in shapes if s[0] != "head"]
    layers = [{shape: pack(o, i, gen) for shape, o, i in layer_shapes}
              for _ in range(args.layers)]
    for rows in args.rows:
        inputs = {shape: torch.randn(rows, i, generator=gen).to(dtype)
                  for shape, _, i in layer_shapes}
        if args.layers == 1:
            for shape, packed in layers[0].items():
                times[shape, rows] = time_calls(packed, inputs[shape], args.calls, args.repeats)
        else:
            for shape, ms in time_stack(layers, inputs, args.repeats).items():
                times[shape, rows] = ms
    print(f"{name}: done", flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=tuple(SHAPES), default="smollm2")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--gguf", action="store_true")
    kind.add_argument("--dense", action="store_true")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", default="benchmarks/results/linear_kernels.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = SHAPES[args.shapes]
    if args.dense:
        shapes = tuple(s for s in shapes if s[0] != "head")
        columns = dense_formats_here()
    else:
        columns = gguf_formats_here() if args.gguf else formats_here()
    times = {name: measure(name, dtype, pack, shapes, args)
             for name, (dtype, pack) in columns.items()}
    results = [{"shape": shape, "out_features": out_features, "in_features": in_features,
                "rows": rows, "column": name, "dtype": str(columns[name][0])[6:],
                "layers": 1 if shape == "head" else args.layers,
                "ms": times[name][shape, rows],
                "speed_vs_none": times["none"][shape, rows] / times[name][shape, rows]}
               for shape, out_features, in_features in shapes for rows in args.rows
               for name in columns]
    table = Table(title=f"ms per call (speed against none), {args.shapes}, "
                        f"{torch.get_num_threads()} thread(s), "
                        f"{args.layers} layer(s) of distinct weights (the head: one); "
                        + ", ".join(f"{name} in {str(dtype)[6:]}"
                                    for name, (dtype, _) in columns.items()))
    table.add_column("shape")
    table.add_column("rows", justify="right")
    for name in columns:
        table.add_column(name, justify="right")
    for shape, *_ in shapes:
        for rows in args.rows:
            cells = {r["column"]: r for r in results
                     if r["shape"] == shape and r["rows"] == rows}
            table.add_row(shape, str(rows), *(
                f"{cells[n]['ms']:.3f} ({cells[n]['speed_vs_none']:.2f}x)" for n in columns))
    Console(width=200).print(table)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    write_report({"args": vars(args), "cpu_flags": flags, "results": results}, args.out)


if __name__ == "__main__":
    main()
