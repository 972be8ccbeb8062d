"""Projections packed for the native linear kernels: each class converts one plain ``[out,
in]`` weight (and its bias) into its kernel's layout once, binds that kernel, and then
computes ``x @ W.T + bias`` (``__call__``) and ``residual + x @ W.T + bias`` (``add``, one
kernel and one rounding) with nothing between the call and the op.

The kernels read the weight once per call and keep memory streaming while they compute:
bfloat16 activations in panels of 32 outputs in VDPBF16PS's pair layout (AVX512-BF16),
float32 ones in panels of 16 for 8-lane FMA (AVX2). int8 and int4 weights are widened in
registers and scaled in float32 (int8 per output row or per 16 or 32 inputs of a row, int4
per 32 inputs). A constructor raises ``KernelUnavailableError`` where ``KernelCapabilities``
says the kernel it needs is not in this build.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.kernels.native import NativeKernels
from tokenmill.models.weights.quantize import (
    check_int4_shape,
    group_panels,
    int4_panels,
    quantize_int8_rows,
    quantize_q4_1_groups,
    quantize_q4_1_panels,
)


def panel_outputs(dtype: torch.dtype) -> int:
    """Outputs per panel of the layout of the linear kernels for ``dtype`` activations:
    32 (bfloat16), 16 (float32)."""
    return 32 if dtype == torch.bfloat16 else 16


def interleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """A gated MLP's gate/up weight ``[2I, in]`` (gate rows, then up rows) with its rows in
    blocks of 16 taken in turn: rows ``32 j .. 32 j + 15`` are gate rows ``16 j ..``, rows
    ``32 j + 16 .. 32 j + 31`` up rows ``16 j ..``. Each panel of 32 outputs then holds the
    same 16 outputs of both, the layout of a gated kernel call (``gated=True``: the linear
    kernels of bfloat16 on AVX512-BF16 and the VNNI ones), whose output ``j`` is
    ``silu(gate_j) * up_j``. Needs ``I % 16 == 0``."""
    rows, in_features = weight.shape
    return weight.view(2, rows // 32, 16, in_features).transpose(0, 1).reshape(rows, in_features)


@dataclass(frozen=True, slots=True)
class KernelCall:
    """A packed weight's kernel call as native code makes it (``DecodeLayers``): the op's
    qualified name, the arguments between ``x`` and ``residual`` and those after it."""

    op: str
    weight_args: list
    trailing_args: list


class KernelWeight:
    """A packed weight whose kernel is ``linear(x, *weight_args, residual, ...)`` (every
    linear op's schema: x, the weight's tensors and sizes, the residual to add or None,
    then options with defaults); subclasses set ``linear`` and give ``weight_args``."""

    linear: Callable[..., torch.Tensor]

    @property
    def weight_args(self) -> tuple:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, *self.weight_args, None)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.linear(x, *self.weight_args, residual)

    def kernel_call(self) -> KernelCall:
        """This weight's call, the options after ``residual`` given as bound (a
        ``functools.partial`` of the op, as ``pack_silu_gated`` binds ``gated``) or as the
        op's defaults."""
        weight_args = list(self.weight_args)
        op, options = self.linear, {}
        if isinstance(op, functools.partial):
            op, options = op.func, op.keywords
        schema = op.default._schema
        trailing = schema.arguments[len(weight_args) + 2:]
        return KernelCall(schema.name, weight_args,
                          [options.get(a.name, a.default_value) for a in trailing])


class NativeWeight(KernelWeight):
    """The weight in its dtype: ``bf16_linear`` (bfloat16) or ``f32_linear`` (float32).
    Same arithmetic as oneDNN's (exact products summed in float32, one rounding)."""

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        ops = kernels.linear_kernels(weight.dtype)
        self.linear = ops.linear
        self.out_features = weight.shape[0]
        self.packed = ops.pack_weight(weight)
        self.bias = bias

    @property
    def weight_args(self) -> tuple:
        return self.packed, self.out_features, self.bias


class ScaledWeight(KernelWeight):
    """The call of the kernels that take one tensor of scales beside the packed weight
    (``linear(x, packed, scales, out_features, bias, residual)``); subclasses set them."""

    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    bias: torch.Tensor | None

    @property
    def weight_args(self) -> tuple:
        return self.packed, self.scales, self.out_features, self.bias


class GroupParamsWeight(KernelWeight):
    """The call of the w4a8 kernels and the VNNI kernels over a GGUF file's blocks:
    ``linear(x, packed, group_params, out_features, bias, residual)``, the blocks' scales
    (and minimums) in one tensor; subclasses set them."""

    packed: torch.Tensor
    group_params: torch.Tensor
    out_features: int
    bias: torch.Tensor | None

    @property
    def weight_args(self) -> tuple:
        return self.packed, self.group_params, self.out_features, self.bias


class NativeInt8Weight(ScaledWeight):
    """int8 weights with one float32 scale per output row (``quantize_int8_rows``) for the
    int8 kernel of the weight's dtype: ``int8_linear`` (bfloat16 activations) or
    ``int8_f32_linear`` (float32)."""

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        ops = kernels.linear_kernels(weight.dtype)
        self.linear = ops.int8_linear
        self.out_features = weight.shape[0]
        q, self.scales = quantize_int8_rows(weight)
        self.packed = ops.int8_pack_weight(q)
        self.bias = bias


class NativeInt8GroupWeight(ScaledWeight):
    """int8 weights with one float32 scale per ``group`` inputs of a row, ``w = q * scale``:
    ``groups`` is ``(q [out, in] int8, scales [out, in / group] float32)``, a GGUF file's own
    blocks (``gguf.blocks.FileRows.int8_groups``: Q8_0 and Q5_0 in groups of 32, Q6_K and
    Q3_K of 16). Packed as ``NativeInt8Weight``'s ``q``, for ``int8_group_linear``
    (bfloat16 activations: each group's float32 sum of ``x q`` times its scale) or
    ``int8_group_f32_linear`` (float32: ``x`` times the weights ``q * scale``, which float32
    holds exactly where they have at most 24 significant bits, as GGUF's do). Either way
    the output is ``x @ w.T`` within float32 summation (and the one rounding to bfloat16).
    ``weight`` gives the shape and the activations' dtype. Invariant: ``group`` (the
    kernels infer it from the scales' shape) is one of ``GROUPS`` and ``in == group *
    scales.shape[1]``; else ``ValueError``."""

    GROUPS = (16, 32)

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None, groups: tuple[torch.Tensor, torch.Tensor]) -> None:
        ops = kernels.linear_kernels(weight.dtype)
        self.linear = ops.int8_group_linear
        q, scales = groups
        in_features, count = q.shape[1], scales.shape[1]
        self.group = in_features // count if count else 0
        if self.group not in self.GROUPS or in_features != self.group * count:
            raise ValueError(f"int8 groups of 16 or 32 inputs: {count} scales a row for "
                             f"{in_features} inputs")
        self.packed = ops.int8_pack_weight(q)
        self.scales = group_panels(scales, panel_outputs(weight.dtype))
        self.out_features = weight.shape[0]
        self.bias = bias


class NativeInt4Weight(KernelWeight):
    """4-bit weights for the int4 kernel of the weight's dtype: ``int4_linear`` (bfloat16
    activations, panels of 32 outputs) or ``int4_f32_linear`` (float32, panels of 16). Per
    ``GROUP`` inputs of a row a float32 scale and minimum, ``w = q * scale + min`` with q in
    0..15: ``groups`` (``q [out, in]``, ``scales, mins [out, in / GROUP]``) where given
    (a GGUF file's own 4-bit blocks, computed on exactly), else quantized from ``weight``
    (the group's minimum and maximum map to 0 and 15, as in a GGUF Q4_1 block, whose
    values it recovers exactly). Needs ``in % GROUP == 0``."""

    GROUP = 32

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None,
                 groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> None:
        out_features, in_features = weight.shape
        check_int4_shape(in_features, self.GROUP, "int4")
        self.linear = kernels.linear_kernels(weight.dtype).int4_linear
        bf16 = weight.dtype == torch.bfloat16
        panel = panel_outputs(weight.dtype)
        if groups is None:
            groups = quantize_q4_1_groups(weight, self.GROUP)
        q, self.scales, self.mins = int4_panels(*groups, panel)
        # [panels, output, K / 2, pair] -> [panels, K / 2, output, pair]: one byte a pair
        q = q.view(q.shape[0], panel, in_features // 2, 2).transpose(1, 2)
        packed = (q[..., 0] | (q[..., 1] << 4)).contiguous()
        # the bfloat16 kernel takes its panel's outputs as [2, 16]
        self.packed = packed.view(-1, in_features // 2, 2, 16) if bf16 else packed
        self.out_features = out_features
        self.bias = bias

    @property
    def weight_args(self) -> tuple:
        return self.packed, self.scales, self.mins, self.out_features, self.bias


class NativeInt4PlanesWeight:
    """A weight that is the sum of ``len(planes)`` 4-bit weights over the same inputs (a
    GGUF file's 5- or 8-bit values split into nibbles, each ``(q [out, in], scales, mins
    [out, in / GROUP])`` as ``NativeInt4Weight`` takes them): one int4 weight over the
    inputs repeated, ``x @ (W_0 + W_1).T = [x, x] @ [W_0, W_1].T``. ``weight`` gives the
    shape and the activations' dtype."""

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None,
                 planes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        out_features, in_features = weight.shape
        self.repeats = len(planes)
        stacked = tuple(torch.cat(parts, dim=1) for parts in zip(*planes, strict=True))
        shape = weight.new_empty(1).expand(out_features, self.repeats * in_features)
        self.inner = NativeInt4Weight(kernels, shape, bias, stacked)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.repeat(1, self.repeats))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.inner.add(x.repeat(1, self.repeats), residual)


class NativeW4A8Weight(GroupParamsWeight):
    """4-bit weights in Q4_1's form with float16 scales and minimums (a Q4_1 file's own
    values, exactly) for ``w4a8_linear``, which quantizes the float32 activations to int8
    per group of 32 inputs at every call and multiplies integers (AVX2). Panels of 16
    outputs in records of 4 inputs: byte ``4 o + j`` of record ``r`` holds input ``4 r + j``
    of output ``o`` in its low nibble and of output ``8 + o`` in its high one;
    ``group_params [panels, K / GROUP, 2, 16]`` the scales, then the minimums, of each
    group's 16 outputs. Needs ``in % GROUP == 0``."""

    GROUP = 32

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        out_features, in_features = weight.shape
        check_int4_shape(in_features, self.GROUP, "w4a8")
        self.linear = kernels.w4a8_linear()
        q, scales, mins = quantize_q4_1_panels(weight, 16, self.GROUP, torch.float16)
        # [panels, half, o, K / 4, j] -> [panels, K / 4, half, o, j]
        q = q.view(q.shape[0], 2, 8, in_features // 4, 4).permute(0, 3, 1, 2, 4)
        self.packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, in_features // 4, 32)
        self.group_params = torch.stack((scales, mins), dim=2).contiguous()
        self.out_features = out_features
        self.bias = bias


VNNI_PANEL = 32  # outputs per panel of the VNNI kernels


def _records(q: torch.Tensor) -> torch.Tensor:
    """Integer weights ``q [N, K]`` in the VNNI kernels' records: N padded with zero rows to
    panels of 32 outputs, ``[panels, K / 4, 2, 16, 4]`` (panel, record of 4 inputs, half of
    the panel's outputs, output, input), element ``[p, r, h, o, j] = q[32 p + 16 h + o,
    4 r + j]``."""
    q = torch.nn.functional.pad(q, (0, 0, 0, -q.shape[0] % VNNI_PANEL))
    return q.view(-1, 2, 16, q.shape[1] // 4, 4).permute(0, 3, 1, 2, 4)


def _byte_records(q: torch.Tensor) -> torch.Tensor:
    """Byte weights ``q [N, K]`` (uint8) in ``_records``' layout, ``[panels, K * 32]``."""
    return _records(q).reshape(-1, q.shape[1] * VNNI_PANEL)


def _nibble_records(q: torch.Tensor) -> torch.Tensor:
    """4-bit weights ``q [N, K]`` (uint8, 0..15) in ``_records``' layout with the panel's two
    halves in one byte, ``[panels, K * 16]``: output ``o`` in the low nibble, ``16 + o`` in
    the high one."""
    halves = _records(q)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, q.shape[1] * 16)


def _panel_params(per_block: list[torch.Tensor], per_super: list[torch.Tensor],
                  blocks_per_super: int) -> torch.Tensor:
    """A GGUF weight's block parameters in the VNNI kernels' panels, ``[panels, bytes]``
    uint8: per panel of 32 outputs and super-block (``blocks_per_super`` blocks of inputs),
    per block the 32 outputs' byte of each of ``per_block`` (``[N, blocks]``, one byte
    each) in turn, then the 32 outputs' float16 values of each of ``per_super`` (``[N,
    super-blocks]``). Rows past N (padding to the panels) are zeros."""
    def by_panel(t: torch.Tensor) -> torch.Tensor:  # [N, cols] -> [panels, cols, 32]
        t = torch.nn.functional.pad(t, (0, 0, 0, -t.shape[0] % VNNI_PANEL))
        return t.view(-1, VNNI_PANEL, t.shape[1]).transpose(1, 2)

    parts = [by_panel(t).contiguous().view(torch.uint8) for t in per_super]
    panels, supers = parts[0].shape[:2]
    if per_block:
        blocks = torch.stack([by_panel(t.view(torch.uint8)) for t in per_block], dim=2)
        parts.insert(0, blocks.reshape(panels, supers, -1))
    return torch.cat(parts, dim=2).reshape(panels, -1)


class DenseAtRowsWeight(GroupParamsWeight):
    """A packed weight of w4a8 or of a GGUF file's blocks (``kind``: ``"w4a8"``, ``"q4_k"``,
    ``"q6_k"``, ``"q8_0"``) on the VNNI integer kernel ``linear`` below ``DENSE_ROWS``
    rows, and from there, for bfloat16 activations on a host with AMX tiles, on oneDNN's
    bfloat16 matmul (AMX) over ``dense_weight()``, the weight's values rounded to bfloat16
    and made for the call alone (the resident memory stays the packed weight's). At a
    prefill's rows the integer kernel is compute-bound and AMX several times as fast; at a
    decode's it is memory-bound and the faster. ``DENSE_ROWS`` exceeds the engine's default
    ``max_num_seqs`` (64), so a decode or verify step's rows always take the integer
    kernel, and a token's bits do not depend on how many sequences decode beside it.
    AVX-512 hosts without AMX keep the integer kernel at every row count (their crossover
    is not measured). A gated call (``pack_silu_gated``) on the dense path gates the
    bfloat16 product: ``silu(gate) * up``."""

    # benchmarks/linear_kernels.py --shapes llama1b --dense on a 2-core AMX host: at 128
    # rows the integer kernel was still the faster on qkv and o (Q4_K 2.3 against 2.9 ms,
    # 1.4 against 1.9), at 256 the dense path on both (8.4 against 3.3, 2.9 against 2.3)
    DENSE_ROWS = 256
    # of the dequantized weight per oneDNN call: under glibc's largest mmap threshold (32
    # MiB), so a chunk's memory is reused from the heap, not mapped and faulted in anew at
    # every call; few chunks, few parallel regions
    DENSE_CHUNK_BYTES = 16 << 20

    kind: str

    def _bind(self, kernels: NativeKernels, dtype: torch.dtype, in_features: int,
              dense: bool = True) -> None:
        """Binds the kind's kernels: ``linear``, the dequantization, and whether calls of
        ``dtype`` activations take the dense path from ``DENSE_ROWS`` rows (never without
        ``dense``)."""
        ops = kernels.vnni_linear()
        self.linear = getattr(ops, self.kind)
        self._dequantize = ops.dequantize
        self.in_features = in_features
        self.dense_rows = (self.DENSE_ROWS if dense and dtype == torch.bfloat16
                           and kernels.capabilities.amx else None)

    def dense_weight(self, panels: slice = slice(None)) -> torch.Tensor:
        """The weight's rows in ``panels`` (of ``VNNI_PANEL`` outputs; by default all),
        ``[rows, in]`` bfloat16: each value the kind's float32 value rounded once."""
        first, last, _ = panels.indices(self.packed.shape[0])
        rows = min(last * VNNI_PANEL, self.out_features) - first * VNNI_PANEL
        return self._dequantize(self.kind, self.packed[first:last],
                                self.group_params[first:last], rows, self.in_features)

    def _dense(self, x: torch.Tensor) -> bool:
        return (self.dense_rows is not None and x.dtype == torch.bfloat16
                and x.shape[0] >= self.dense_rows)

    def dense_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ dense_weight().T + bias`` by oneDNN, the weight dequantized and multiplied
        ``DENSE_CHUNK_BYTES`` of it at a time (whole panels); gated: ``silu(gate) * up``."""
        step = max(1, self.DENSE_CHUNK_BYTES // (VNNI_PANEL * self.in_features * 2))
        parts = [torch.nn.functional.linear(
                     x, self.dense_weight(slice(p, p + step)),
                     None if self.bias is None
                     else self.bias[p * VNNI_PANEL:(p + step) * VNNI_PANEL])
                 for p in range(0, self.packed.shape[0], step)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if isinstance(self.linear, functools.partial) and self.linear.keywords.get("gated"):
            halves = y.view(y.shape[0], -1, 2, 16)  # interleave_gate_up's panels
            y = (torch.nn.functional.silu(halves[:, :, 0]) * halves[:, :, 1]).flatten(1)
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense(x):
            return self.dense_product(x)
        return super().__call__(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self._dense(x):
            return residual + self.dense_product(x)
        return super().add(x, residual)


class NativeW8A8Weight(ScaledWeight):
    """int8 weights with one float32 scale per output row (``quantize_int8_rows``) for
    ``vnni_w8a8_linear``, which quantizes the activations (bfloat16 or float32) to int8 per
    block of 64 inputs (32 where ``in`` is not a multiple of 64) at every call and
    multiplies integers (AVX512-VNNI). Stored as
    ``q + 128`` (unsigned: the operand VPDPBUSD takes) in ``_records``' layout, ``[panels,
    K * 32]`` bytes; scales padded to the panels. Needs ``in % 32 == 0``."""

    BLOCK = 32

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        out_features, in_features = weight.shape
        check_int4_shape(in_features, self.BLOCK, "w8a8")
        self.linear = kernels.vnni_linear().w8a8
        q, scales = quantize_int8_rows(weight)
        unsigned = (q.to(torch.int16) + 128).to(torch.uint8)
        self.packed = _records(unsigned).reshape(-1, in_features * VNNI_PANEL)
        self.scales = torch.nn.functional.pad(scales, (0, -out_features % VNNI_PANEL))
        self.out_features = out_features
        self.bias = bias


class NativeVnniW4A8Weight(DenseAtRowsWeight):
    """4-bit weights in Q4_1's form with float16 scales and minimums for
    ``vnni_w4a8_linear``, which quantizes the activations (bfloat16 or float32) to int8 per
    group of 32 inputs at every call and multiplies integers (AVX512-VNNI): ``groups``
    (``q [out, in]`` in 0..15, ``scales, mins [out, in / GROUP]`` float16) where given (a
    GGUF Q4_0 or Q4_1 file's own values, exactly), else quantized from ``weight``.
    ``_nibble_records``' layout; ``group_params [panels, K / GROUP, 2, 32]`` the scales,
    then the minimums, of each group's 32 outputs. Needs ``in % GROUP == 0``. Only a
    file's values (``groups`` given) take ``DENSE_ROWS`` rows densely: weights quantized
    here (``--quantization w4a8``, which ``batch_invariant`` may take) keep the integer
    kernel, each row alone, at every row count."""

    GROUP = 32
    kind = "w4a8"

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None,
                 groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> None:
        out_features, in_features = weight.shape
        check_int4_shape(in_features, self.GROUP, "w4a8")
        self._bind(kernels, weight.dtype, in_features, dense=groups is not None)
        if groups is None:
            groups = quantize_q4_1_groups(weight, self.GROUP, torch.float16)
        q, scales, mins = groups
        self.packed = _nibble_records(q)
        self.group_params = torch.stack((group_panels(scales, VNNI_PANEL),
                                         group_panels(mins, VNNI_PANEL)), dim=2).contiguous()
        self.out_features = out_features
        self.bias = bias


class NativeVnniQ4KWeight(DenseAtRowsWeight):
    """A GGUF file's own Q4_K blocks (``FileRows.own_fields()``: ``(q, sc, mn, d, dmin)``,
    ``w = d sc q - dmin mn``) for ``vnni_q4_k_linear``: w4a8's arithmetic, activations
    quantized to int8 per 32 inputs at every call (AVX512-VNNI), with each block's scale
    ``d sc`` and minimum ``-(dmin mn)`` formed in the kernel, exactly in float32 (11 by 6
    significant bits): the file's dequantized values bit for bit. ``q`` in
    ``_nibble_records``' layout; ``group_params`` per panel and super-block of 256 inputs
    the 8 blocks' ``sc``, then ``mn``, of the 32 outputs (bytes), then their ``d`` and
    ``dmin`` (``_panel_params``): 4.625 bits a weight (the file's 4.5). ``weight`` gives
    the shape; ``in`` is whole super-blocks, as GGUF rows are."""

    SUPER = 8  # blocks of 32 per super-block
    kind = "q4_k"

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None, fields: tuple[torch.Tensor, ...]) -> None:
        q, sc, mn, d, dmin = fields
        self._bind(kernels, weight.dtype, weight.shape[1])
        self.packed = _nibble_records(q)
        self.group_params = _panel_params([sc, mn], [d, dmin], self.SUPER)
        self.out_features = weight.shape[0]
        self.bias = bias


class NativeVnniQ8_0Weight(DenseAtRowsWeight):
    """A GGUF file's own Q8_0 blocks (``FileRows.own_fields()``: ``(q, d)``, ``w = d q``)
    for ``vnni_q8_0_linear``, activations quantized to int8 per 32 inputs at every call
    (AVX512-VNNI). ``q + 128`` (unsigned, as VPDPBUSD takes it; the kernel takes the 128s
    out with each block's sum of the int8 activations) in ``_byte_records``' layout;
    ``group_params`` per panel and block of 32 inputs the 32 outputs' float16 ``d``
    (``_panel_params``): 8.5 bits a weight, the file's. ``weight`` gives the shape."""

    kind = "q8_0"

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None, fields: tuple[torch.Tensor, ...]) -> None:
        q, d = fields
        self._bind(kernels, weight.dtype, weight.shape[1])
        self.packed = _byte_records((q.to(torch.int16) + 128).to(torch.uint8))
        self.group_params = _panel_params([], [d], 1)
        self.out_features = weight.shape[0]
        self.bias = bias


class NativeVnniQ6KWeight(DenseAtRowsWeight):
    """A GGUF file's own Q6_K blocks (``FileRows.own_fields()``: ``(q, sc, d)``, ``w = d sc
    (q - 32)``) for ``vnni_q6_k_linear``, activations quantized to int8 per 16 inputs (the
    weights' groups) at every call (AVX512-VNNI), each group's scale ``d sc`` formed in the
    kernel, exactly in float32. ``q`` (0..63: unsigned, as VPDPBUSD takes it; the kernel
    takes the 32s out with each block's sum of the int8 activations) a byte each in
    ``_byte_records``' layout; ``group_params`` per panel and super-block of 256 inputs the
    16 groups' ``sc`` of the 32 outputs, then their ``d`` (``_panel_params``): 9.125 bits a
    weight (the file's 6.5625: 6-bit packing is not done). ``weight`` gives the shape;
    ``in`` is whole super-blocks, as GGUF rows are."""

    SUPER = 16  # groups of 16 per super-block
    kind = "q6_k"

    def __init__(self, kernels: NativeKernels, weight: torch.Tensor,
                 bias: torch.Tensor | None, fields: tuple[torch.Tensor, ...]) -> None:
        q, sc, d = fields
        self._bind(kernels, weight.dtype, weight.shape[1])
        self.packed = _byte_records(q)
        self.group_params = _panel_params([sc], [d], self.SUPER)
        self.out_features = weight.shape[0]
        self.bias = bias
