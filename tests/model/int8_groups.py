"""int8 weights with a scale per group of inputs (``NativeInt8GroupWeight``'s operands) for
the linear kernel tests: random ones, and the weight they stand for."""

from __future__ import annotations

import torch


def int8_groups(out_features: int, in_features: int, gen: torch.Generator, group: int = 32
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 q and a scale per ``group`` inputs of a row, float16 values (as a GGUF
    Q8_0 block's d): q * scale is exact in float32."""
    q = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_features, in_features // group, generator=gen) / 100
    return q, scales.half().float()


def group_weight(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What int8 groups stand for, q * scale, in float64 (the group size: the inputs per
    scale)."""
    group = q.shape[1] // scales.shape[1]
    return (q.double().view(q.shape[0], -1, group) * scales.double()[..., None]).view(q.shape)
