"""How a projection's weight is stored for the kernels that multiply by it.

After loading, ``choose_weight_format(dtype, device, quantization, native)`` names the
fastest exact-enough form this host supports, and every ``Linear`` (and the tied output
head) converts its plain ``[out, in]`` weight into it once:

- ``NativeWeight``: the engine's native kernels (``tokenmill.kernels``), which read the
  weight once per call and keep memory streaming while they compute:
  - bfloat16 on a CPU with AVX512-BF16 but no AMX: panels of 32 outputs in VDPBF16PS's
    pair layout. Same arithmetic as oneDNN's bfloat16 kernels (exact products summed in
    float32, one rounding), 1.2 to 1.6x oneDNN's speed at 1 to 64 rows, equal at 512. A
    CPU with AMX keeps oneDNN, whose AMX tiles multiply a prefill's rows several times
    faster than VDPBF16PS can.
  - float32 on a CPU with AVX2 and FMA but no AVX-512: panels of 16 outputs for 8-lane
    FMA. Same arithmetic as ``F.linear`` (float32 products and sums), 1.3 to 2.5x
    oneDNN's speed at 1 to 64 rows, about equal at 256 (where oneDNN has AVX-512, it
    keeps its kernels: twice this peak).
- ``OneDNNWeight``: oneDNN's blocked layout, for the CPU in float32, bfloat16 or float16.
  Same arithmetic as ``F.linear`` (one product and sum per output, in the dtype), about
  twice as fast for the small batches of decoding. Only where oneDNN can reorder the
  dtype on this CPU: its bfloat16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, so an
  AVX2-only host keeps bfloat16 weights plain (``onednn_supports`` probes it).
- ``Int8Weight``: ``--quantization int8``, CPU, bfloat16 or float32 activations. Weights
  are int8 with one scale per output row (symmetric), widened inside the kernel
  (weight-only: a quarter of float32's bytes to read per decode step). Activations stay
  in floating point because quantizing them too (dynamic int8, per tensor or per row)
  raised the embedded model's perplexity by 5 to 12%; weight-only int8 costs 0.2%.
  (``NativeW4A8Weight`` quantizes them per block of 16 inputs, which costs far less.)
- ``NativeInt8Weight``: the same int8 weights and scales (float32 scales) for a native
  int8 kernel, where the engine has one: the native kernel's panels with int8 elements,
  widened in registers. bfloat16 activations (AVX512-BF16): 1.5x the bfloat16 kernel's
  speed at one row, 1.9 to 2.4x PyTorch's int8 kernel; float32 activations (AVX2): 2 to
  2.8x the float32 kernel's speed at one row, about equal from 8 rows on.
- ``NativeInt4Weight``: ``--quantization int4`` with the native ``int4_linear`` kernel
  (AVX512-BF16): 4-bit values in the same panels, a float32 scale and minimum per 32
  inputs of a row (Q4_1's own form, so a Q4_1 file's values come back exactly, scales
  included); about as fast as native int8 (faster at one row), 1.8x PyTorch's 4-bit
  kernel at 16 rows and more. Its head is ``NativeInt8Weight``. On AVX2 hosts
  (``int4_f32_linear``) the same with panels of 16 and float32 activations.
- ``NativeW4A8Weight``: ``--quantization w4a8``, CPU with AVX2 (``w4a8_linear``): the
  same 4-bit weights with float16 scales and minimums (a Q4_1 file's own), times float32
  activations quantized to int8 per block of 16 inputs at every call, multiplied as
  integers (VPMADDUBSW: 32 products per instruction, four times a float32 FMA's). On a
  2-core AVX2 host, over SmolLM2's layers, 3.5x the float32 kernel's speed at one row,
  2.3x at 16, 1.9x at 64 and 1.7x at 256; the accuracy cost (about 1% perplexity on
  the embedded model) is the activations' rounding. Its head is ``NativeInt8Weight`` with
  float32 activations.
- ``Int4Weight``: ``--quantization int4``, CPU, bfloat16 or float32 activations (PyTorch's
  4-bit kernel). Weights are 4-bit with a scale and a zero per 32 inputs (asymmetric: the
  group's minimum and maximum map to 0 and 15), the layout of a GGUF file's Q4_1 blocks:
  from such a file's dequantized weights it recovers the file's own 4-bit values, and in
  bfloat16 only its fp16 scales and minimums are rounded (in float32 they are exact). An
  eighth of float32's bytes. The output head keeps ``Int8Weight`` (a GGUF file stores it
  in 8 bits; 4 bits there cost accuracy).
- ``None``: plain ``F.linear`` (CUDA, or no packed form for this dtype here).

Every format computes ``x @ W.T + bias`` (``__call__``) and ``residual + x @ W.T + bias``
(``add``); oneDNN fuses the add into the product.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.hardware import cpu_has_amx
from tokenmill.kernels import NativeOps


class OneDNNWeight:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # tuned for batch 1
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """One oneDNN call, one rounding of the sum."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias,
                                                         "add")


class NativeWeight:
    """Weights for the native linear kernel of their dtype: ``bf16_linear`` (bfloat16) or
    ``f32_linear`` (float32); needs that kernel in ``ops``."""

    def __init__(self, ops: NativeOps, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        bf16 = weight.dtype == torch.bfloat16
        self.linear = ops.bf16_linear if bf16 else ops.f32_linear
        self.out_features = weight.shape[0]
        self.packed = (ops.bf16_pack_weight if bf16 else ops.f32_pack_weight)(weight)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.packed, self.out_features, self.bias, None)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """One kernel, one rounding of the sum."""
        return self.linear(x, self.packed, self.out_features, self.bias, residual)


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``q``, float32 ``scales``) with ``weight ~= q * scales[:, None]``, symmetric:
    each row's largest magnitude maps to 127."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    return (weight / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8), scales


class Int8Weight:
    """int8 weights, one scale per output row (symmetric); activations in the dtype of the
    weight it is made from (bfloat16 or float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, scales = quantize_int8_rows(weight)
        self.scales = scales.to(weight.dtype)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return out if self.bias is None else out.add_(self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self(x).add_(residual)


class NativeInt8Weight:
    """``Int8Weight``'s quantization for the native int8 kernel of the weight's dtype:
    ``int8_linear`` (bfloat16 activations) or ``int8_f32_linear`` (float32); the scales
    stay float32."""

    def __init__(self, ops: NativeOps, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        bf16 = weight.dtype == torch.bfloat16
        self.linear = ops.int8_linear if bf16 else ops.int8_f32_linear
        self.out_features = weight.shape[0]
        q, self.scales = quantize_int8_rows(weight)
        self.packed = (ops.int8_pack_weight if bf16 else ops.int8_f32_pack_weight)(q)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.packed, self.scales, self.out_features, self.bias, None)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.packed, self.scales, self.out_features, self.bias, residual)


class Int4Weight:
    """4-bit weights, asymmetric, one scale and zero per ``GROUP`` inputs of a row;
    activations, scales and zeros in the dtype of the weight it is made from (bfloat16 or
    float32). Needs ``in % GROUP == 0`` and ``out % 16 == 0`` (the kernel's packing)."""

    GROUP = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_features, in_features = weight.shape
        if in_features % self.GROUP or out_features % 16:
            raise InvalidParameterError(
                f"--quantization int4 needs projections of a multiple of {self.GROUP} inputs "
                f"and 16 outputs, this model has {in_features} -> {out_features}: use int8",
                "quantization")
        groups = weight.float().view(out_features, in_features // self.GROUP, self.GROUP)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        # The kernel computes (q - 8) * scale + zero with scale and zero in the dtype: round
        # them first, then pick each q against the rounded pair, so the rounding of a zero
        # far from 0 (a group of weights all of one sign) is made up for by q where it can.
        dtype = weight.dtype
        scales = ((high - low) / 15).clamp_min(torch.finfo(dtype).tiny).to(dtype).float()
        zeros = (low + 8 * scales).to(dtype).float()
        values = ((groups - zeros) / scales + 8).round_().clamp_(0, 15).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            values.view(out_features, in_features), 2)
        self.scales_and_zeros = torch.stack(
            (scales.view(out_features, -1).t(), zeros.view(out_features, -1).t()),
            dim=-1).contiguous().to(dtype)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.GROUP,
                                                         self.scales_and_zeros)
        return out if self.bias is None else out.add_(self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self(x).add_(residual)


def quantize_q4_1_panels(weight: torch.Tensor, panel: int, group: int,
                         dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1's quantization of ``weight [N, K]`` by panels of ``panel`` outputs (N
    padded with zero rows): ``(q [panels, panel, K] uint8, scales, mins [panels, K / group,
    panel] in dtype)`` with ``w = q * scale + min``, q in 0..15, each group of ``group``
    inputs of a row mapping its minimum and maximum to 0 and 15. In float16 (a Q4_1 file's
    own dtype: its values come back exactly) each q is picked against the rounded scale
    and minimum."""
    out_features, in_features = weight.shape
    panels = -(-out_features // panel)
    padded = torch.zeros(panels * panel, in_features)
    padded[:out_features] = weight.float()
    groups = padded.view(-1, in_features // group, group)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scales = ((high - low) / 15).clamp_min(torch.finfo(dtype).tiny).to(dtype)
    mins = low.to(dtype)
    q = ((groups - mins.float()) / scales.float()).round_().clamp_(0, 15).to(torch.uint8)
    # [panels * panel, groups] -> [panels, groups, panel]
    scales, mins = (t.view(panels, panel, -1).transpose(1, 2).contiguous()
                    for t in (scales, mins))
    return q.view(panels, panel, in_features), scales, mins


def _check_int4_shape(in_features: int, group: int, quantization: str) -> None:
    if in_features % group:
        raise InvalidParameterError(
            f"--quantization {quantization} needs projections of a multiple of {group} "
            f"inputs, this model has {in_features}: use int8", "quantization")


class NativeInt4Weight:
    """4-bit weights for the native int4 kernel of the weight's dtype: ``int4_linear``
    (bfloat16 activations, panels of 32 outputs) or ``int4_f32_linear`` (float32, panels
    of 16). Per ``GROUP`` inputs of a row a float32 scale and minimum, ``w = q * scale +
    min`` with q in 0..15 (the group's minimum and maximum map to 0 and 15, as in a GGUF
    Q4_1 block, whose values it recovers exactly). Needs ``in % GROUP == 0``."""

    GROUP = 32

    def __init__(self, ops: NativeOps, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_features, in_features = weight.shape
        _check_int4_shape(in_features, self.GROUP, "int4")
        bf16 = weight.dtype == torch.bfloat16
        panel = 32 if bf16 else 16  # outputs per panel of the kernel's layout
        q, self.scales, self.mins = quantize_q4_1_panels(weight, panel, self.GROUP)
        # [panels, output, K / 2, pair] -> [panels, K / 2, output, pair]: one byte a pair
        q = q.view(q.shape[0], panel, in_features // 2, 2).transpose(1, 2)
        packed = (q[..., 0] | (q[..., 1] << 4)).contiguous()
        # the bfloat16 kernel takes its panel's outputs as [2, 16]
        self.packed = packed.view(-1, in_features // 2, 2, 16) if bf16 else packed
        self.linear = ops.int4_linear if bf16 else ops.int4_f32_linear
        self.out_features = out_features
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.packed, self.scales, self.mins, self.out_features,
                           self.bias, None)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.packed, self.scales, self.mins, self.out_features,
                           self.bias, residual)


class NativeW4A8Weight:
    """``--quantization w4a8``: 4-bit weights in Q4_1's form with float16 scales and
    minimums (a Q4_1 file's own values, exactly) for the native ``w4a8_linear`` kernel,
    which quantizes the float32 activations to int8 per block of 16 inputs at every call
    and multiplies integers (AVX2). Panels of 16 outputs in records of 4 inputs: byte
    ``4 o + j`` of record ``r`` holds input ``4 r + j`` of output ``o`` in its low nibble
    and of output ``8 + o`` in its high one; ``group_params [panels, K / GROUP, 2, 16]``
    the scales, then the minimums, of each group's 16 outputs. Needs ``in % GROUP == 0``."""

    GROUP = 32

    def __init__(self, ops: NativeOps, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_features, in_features = weight.shape
        _check_int4_shape(in_features, self.GROUP, "w4a8")
        q, scales, mins = quantize_q4_1_panels(weight, 16, self.GROUP, torch.float16)
        # [panels, half, o, K / 4, j] -> [panels, K / 4, half, o, j]
        q = q.view(q.shape[0], 2, 8, in_features // 4, 4).permute(0, 3, 1, 2, 4)
        self.packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, in_features // 4, 32)
        self.group_params = torch.stack((scales, mins), dim=2).contiguous()
        self.linear = ops.w4a8_linear
        self.out_features = out_features
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.packed, self.group_params, self.out_features, self.bias,
                           None)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.packed, self.group_params, self.out_features, self.bias,
                           residual)


PackedWeight = (OneDNNWeight | NativeWeight | Int8Weight | NativeInt8Weight | Int4Weight
                | NativeInt4Weight | NativeW4A8Weight)
# A format is called as ``fmt(weight, bias)`` and returns the packed projection.
WeightFormat = Callable[[torch.Tensor, torch.Tensor | None], PackedWeight]


def head_format(fmt: WeightFormat) -> WeightFormat:
    """The format of the output head when the projections take ``fmt``: 4-bit projections
    keep an int8 head (a GGUF file stores it in 8 bits; 4 bits there cost accuracy: a
    w4a8 head raised the embedded model's perplexity by 8.2%, against 1.4% with int8)."""
    if fmt is Int4Weight:
        return Int8Weight
    if isinstance(fmt, functools.partial) and fmt.func is NativeInt4Weight:
        return functools.partial(NativeInt8Weight, *fmt.args)
    if isinstance(fmt, functools.partial) and fmt.func is NativeW4A8Weight:
        native = fmt.args[0]  # float32 activations: native int8 where the CPU has it
        return (functools.partial(NativeInt8Weight, native) if native.int8_f32_linear
                else Int8Weight)
    return fmt


def choose_weight_format(dtype: torch.dtype, device: torch.device, quantization: str = "none",
                         native: NativeOps | None = None) -> WeightFormat | None:
    """The format every projection takes after loading; None keeps plain weights.
    ``native``: the engine's native kernels, where it uses them.

    Raises ``InvalidParameterError`` for a quantization this device or dtype cannot run.
    """
    if quantization in ("int8", "int4", "w4a8"):
        if device.type != "cpu":
            raise InvalidParameterError(f"--quantization {quantization} runs on the CPU only",
                                        "quantization")
        if quantization == "w4a8":
            return _w4a8_format(dtype, native)
        if dtype not in (torch.bfloat16, torch.float32):
            raise InvalidParameterError(
                f"--quantization {quantization} computes in bfloat16 or float32: use --dtype "
                "auto, bfloat16 or float32", "quantization")
        native_kernel = _has_native_kernel(native, quantization, dtype)
        if quantization == "int4":
            return functools.partial(NativeInt4Weight, native) if native_kernel else Int4Weight
        return functools.partial(NativeInt8Weight, native) if native_kernel else Int8Weight
    assert quantization == "none", "EngineConfig validates the name"
    if (device.type == "cpu" and _has_native_kernel(native, quantization, dtype)
            and not (dtype == torch.bfloat16 and cpu_has_amx())):
        return functools.partial(NativeWeight, native)
    if device.type == "cpu" and onednn_supports(dtype):
        return OneDNNWeight
    return None


def _w4a8_format(dtype: torch.dtype, native: NativeOps | None) -> WeightFormat:
    """w4a8 exists only as the native kernel (float32 activations, its head int8 too)."""
    if dtype != torch.float32:
        raise InvalidParameterError("--quantization w4a8 takes float32 activations: use "
                                    "--dtype auto or float32", "quantization")
    if native is None or native.w4a8_linear is None:
        raise InvalidParameterError("--quantization w4a8 needs the native kernels of a CPU with "
                                    "AVX2, FMA and F16C (and kernels auto or native): use "
                                    "int4", "quantization")
    return functools.partial(NativeW4A8Weight, native)


# The native linear kernel (its ``NativeOps`` field) for each quantization and dtype.
_NATIVE_KERNELS = {
    ("none", torch.bfloat16): "bf16_linear", ("none", torch.float32): "f32_linear",
    ("int8", torch.bfloat16): "int8_linear", ("int8", torch.float32): "int8_f32_linear",
    ("int4", torch.bfloat16): "int4_linear", ("int4", torch.float32): "int4_f32_linear",
}


def _has_native_kernel(native: NativeOps | None, quantization: str, dtype: torch.dtype) -> bool:
    field = _NATIVE_KERNELS.get((quantization, dtype))
    return native is not None and field is not None and getattr(native, field) is not None


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder (and so multiply) ``dtype`` weights on this CPU: tried
    once on a small weight, since the answer depends on the instruction set."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        OneDNNWeight(torch.zeros(16, 16, dtype=dtype), None)(torch.zeros(1, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True
