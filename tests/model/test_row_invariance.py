"""Each row of a projection is computed alone: its bits do not depend on how many rows the
call has. Every format keeps this at a decode or verify step's sizes (what makes
speculation and batching exact); the native formats at every size, which is why
``batch_invariant`` takes them alone."""

from __future__ import annotations

import pytest
import torch
from int8_groups import int8_groups

from tokenmill.errors import InvalidParameterError
from tokenmill.models.weights.formats import (
    NativeFormat,
    NativeInt4Format,
    NativeInt8Format,
    NativeVnniW4A8Format,
    NativeW4A8Format,
    NativeW8A8Format,
)
from tokenmill.models.weights.native_weights import (
    NativeInt4Weight,
    NativeInt8GroupWeight,
    NativeInt8Weight,
    NativeVnniW4A8Weight,
    NativeW4A8Weight,
    NativeW8A8Weight,
    NativeWeight,
)
from tokenmill.models.weights.quantizations import choose_weight_format
from tokenmill.models.weights.torch_weights import (
    Int4Weight,
    Int8Weight,
    OneDNNWeight,
    onednn_supports,
)

CPU = torch.device("cpu")
DECODE_SIZES = (1, 2, 3, 5, 8, 9, 16, 17)
PREFILL_SIZES = (64, 130, 300)
# inputs: 19 groups of 32 and 38 of 16 (an odd count and an even one)
IN_FEATURES = 608


def formats(native) -> list[tuple[str, torch.dtype, type, bool]]:
    """(name, dtype, packed class, native) of every format this host runs."""
    caps = native.capabilities
    out = [(f"onednn-{d}", d, OneDNNWeight, False)
           for d in (torch.bfloat16, torch.float16, torch.float32) if onednn_supports(d)]
    out += [(f"torch-{name}-{d}", d, cls, False) for name, cls in (("int8", Int8Weight),
                                                                  ("int4", Int4Weight))
            for d in (torch.bfloat16, torch.float32)]
    for d in (torch.bfloat16, torch.float32):
        if caps.linear(d):
            out += [(f"native-{name}-{d}", d, cls, True) for name, cls in (
                ("float", NativeWeight), ("int8", NativeInt8Weight), ("int4", NativeInt4Weight),
                ("int8-groups-16", NativeInt8GroupWeight),
                ("int8-groups-32", NativeInt8GroupWeight))]
    if caps.w4a8_linear:
        out.append(("native-w4a8", torch.float32, NativeW4A8Weight, True))
    if caps.vnni_linear:
        out += [(f"native-vnni-{name}-{d}", d, cls, True)
                for name, cls in (("w8a8", NativeW8A8Weight), ("w4a8", NativeVnniW4A8Weight))
                for d in (torch.bfloat16, torch.float32)]
    return out


def pack(name: str, cls: type, weight: torch.Tensor, native):
    if cls is NativeInt8GroupWeight:
        group = int(name.split("-")[3])  # native-int8-groups-<size>-<dtype>
        gen = torch.Generator().manual_seed(group)
        return cls(native, weight, None, int8_groups(*weight.shape, gen, group))
    if cls in (NativeWeight, NativeInt8Weight, NativeInt4Weight, NativeW4A8Weight,
               NativeW8A8Weight, NativeVnniW4A8Weight):
        return cls(native, weight, None)
    return cls(weight, None)


def test_rows_do_not_depend_on_the_row_count(native) -> None:
    gen = torch.Generator().manual_seed(0)
    failures = []
    for name, dtype, cls, is_native in formats(native):
        weight = (torch.randn(320, IN_FEATURES, generator=gen) * 0.05).to(dtype)
        x = torch.randn(max(PREFILL_SIZES), IN_FEATURES, generator=gen).to(dtype)
        residual = torch.randn(max(PREFILL_SIZES), 320, generator=gen).to(dtype)
        packed = pack(name, cls, weight, native)
        sizes = DECODE_SIZES + (PREFILL_SIZES if is_native else ())
        alone = torch.cat([packed(x[r:r + 1]) for r in range(max(sizes))])
        alone_add = torch.cat([packed.add(x[r:r + 1], residual[r:r + 1])
                               for r in range(max(sizes))])
        for m in sizes:
            if not (torch.equal(packed(x[:m]), alone[:m])
                    and torch.equal(packed.add(x[:m], residual[:m]), alone_add[:m])):
                failures.append((name, m))
    assert not failures


@pytest.mark.parametrize("quantization, classes", [
    ("none", (NativeFormat,)), ("int8", (NativeInt8Format,)), ("int4", (NativeInt4Format,)),
    ("w4a8", (NativeVnniW4A8Format, NativeW4A8Format)), ("w8a8", (NativeW8A8Format,))])
def test_batch_invariant_takes_native_formats_or_refuses(native, quantization, classes) -> None:
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        try:
            chosen = choose_weight_format(dtype, CPU, quantization, native,
                                          batch_invariant=True)
        except InvalidParameterError as error:
            assert error.param == "batch_invariant"
            if quantization in ("w4a8", "w8a8"):  # the format and a native head
                runs = (any(cls.supports(dtype, native) for cls in classes)
                        and native.capabilities.linear(dtype))
            else:
                runs = native.capabilities.linear(dtype)
            assert not runs, f"{quantization} {dtype}: the host has its native kernel"
            continue
        assert type(chosen) in classes
        assert type(chosen.head).__name__.startswith("Native")
    with pytest.raises(InvalidParameterError):
        choose_weight_format(torch.bfloat16, torch.device("cuda"), quantization, native,
                             batch_invariant=True)
