"""The integer forms the quantized weight formats store (PyTorch's kernels and the native
ones alike): int8 rows and GGUF Q4_1's 4-bit groups; and the native kernels' panel layout of
per-group numbers."""

from __future__ import annotations

import torch

from tokenmill.errors import InvalidParameterError


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``q``, float32 ``scales``) with ``weight ~= q * scales[:, None]``, symmetric:
    each row's largest magnitude maps to 127."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    return (weight / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8), scales


def quantize_q4_1_groups(weight: torch.Tensor, group: int, dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1's quantization of ``weight [N, K]``: ``(q [N, K] uint8, scales, mins
    [N, K / group] in dtype)`` with ``w = q * scale + min``, q in 0..15, each group of
    ``group`` inputs of a row mapping its minimum and maximum to 0 and 15. In float16 (a
    Q4_1 file's own dtype: its values come back exactly) each q is picked against the
    rounded scale and minimum."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // group, group)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scales = ((high - low) / 15).clamp_min(torch.finfo(dtype).tiny).to(dtype)
    mins = low.to(dtype)
    q = ((groups - mins.float()) / scales.float()).round_().clamp_(0, 15).to(torch.uint8)
    return q.view(out_features, in_features), scales.squeeze(-1), mins.squeeze(-1)


def group_panels(params: torch.Tensor, panel: int) -> torch.Tensor:
    """Numbers per group of inputs, ``[N, K / group]`` (scales or minimums), by panels of
    ``panel`` outputs, N padded with zeros: ``[panels, K / group, panel]``, output
    ``panel * p + o`` at ``[p, :, o]`` (the native kernels' layout)."""
    padded = torch.nn.functional.pad(params, (0, 0, 0, -params.shape[0] % panel))
    return padded.view(-1, panel, padded.shape[1]).transpose(1, 2).contiguous()


def int4_panels(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, panel: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit groups ``q [N, K]``, ``scales, mins [N, K / group]`` by panels of ``panel``
    outputs (N padded with zero rows, scales and minimums): ``(q [panels, panel, K],
    scales, mins [panels, K / group, panel])``."""
    q = torch.nn.functional.pad(q, (0, 0, 0, -q.shape[0] % panel))
    return (q.view(-1, panel, q.shape[1]), group_panels(scales, panel),
            group_panels(mins, panel))


def quantize_q4_1_panels(weight: torch.Tensor, panel: int, group: int,
                         dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_q4_1_groups`` by panels of ``panel`` outputs (``int4_panels``)."""
    return int4_panels(*quantize_q4_1_groups(weight, group, dtype), panel)


def check_int4_shape(in_features: int, group: int, quantization: str) -> None:
    """Raises ``InvalidParameterError`` unless ``group`` divides ``in_features``."""
    if in_features % group:
        raise InvalidParameterError(
            f"--quantization {quantization} needs projections of a multiple of {group} "
            f"inputs, this model has {in_features}: use int8", "quantization")
