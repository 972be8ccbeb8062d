"""What the native kernels can do on this CPU, as this build compiled them.

Every build has the kernels for attention over decodes, RMSNorm, the SiLU gate, rotary
embedding with the KV store, sampling and logprobs, and the fused decode layers. The
others exist only where the build's variant gives the compiler the instructions they are
written in (each ``.cpp`` compiles them under an ``#if`` on those): ``KernelCapabilities``
records which, once, and everything that chooses a kernel asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.hardware import cpu_has_amx, cpu_has_avx512f

# The head sizes paged_prefill_attention.cpp computes, and those of the register-blocked
# paths of paged_decode_attention.cpp.
PREFILL_HEAD_DIMS = frozenset({64, 128, 256})
BLOCKED_DECODE_HEAD_DIMS = PREFILL_HEAD_DIMS


@dataclass(frozen=True, slots=True)
class KernelCapabilities:
    """Invariant: a capability that is False is never chosen (weight format, attention),
    and its op is not registered in this build."""

    bf16_linear: bool
    """Linear layers over bfloat16, int8 (a scale per output row or per 16 or 32 inputs)
    or int4 weights, bfloat16 activations (AVX512-BF16 and AVX512-BW)."""
    f32_linear: bool
    """Linear layers over float32, int8 (a scale per output row or per 16 or 32 inputs) or
    int4 weights, float32 activations (AVX2 and FMA)."""
    w4a8_linear: bool
    """4-bit weights times float32 activations quantized to int8 per group of 32 inputs,
    multiplied as integers (AVX2, FMA and F16C)."""
    vnni_linear: bool
    """int8 or 4-bit weights times bfloat16 or float32 activations quantized to int8 per
    block of inputs (int8 weights: 64, or 32 where 64 do not divide them; 4-bit: 32),
    multiplied as integers (AVX512-VNNI); the same over a GGUF file's own Q4_K, Q8_0 (per
    32) and Q6_K (per 16) blocks."""
    prefill_attention_head_dims: frozenset[int]
    """Head sizes of the causal prefill attention kernel, bfloat16 only (AVX512-BF16);
    empty without it."""
    avx512: bool
    """The CPU has AVX-512F: oneDNN's float32 kernels have twice ``f32_linear``'s peak
    there, so the weight formats keep PyTorch's for float32
    (``models.weights.formats.native_linear_fastest``)."""
    amx: bool
    """The CPU has AMX-BF16 tiles: PyTorch's attention multiplies a prefill's rows with
    them (faster than the native prefill attention)."""
    decode_layers: bool
    """``DecodeLayers``, a Llama decoder stack's step in one call (``decode_layers.cpp``:
    every build has it; it calls the other ops, each where this record has it)."""
    linear_tiles: bool
    """``bf16_linear`` multiplies on AMX tiles (a build for an AMX CPU whose kernel grants
    this process the tiles); without them, on an AMX CPU oneDNN's bfloat16 kernels are
    several times faster at a prefill's sizes, so bfloat16 weights keep oneDNN there."""

    @classmethod
    def of_loaded_library(cls) -> KernelCapabilities:
        """The capabilities of the build ``build.load_library()`` loaded."""
        ops = torch.ops.tokenmill
        bf16 = hasattr(ops, "bf16_linear")
        return cls(bf16_linear=bf16, f32_linear=hasattr(ops, "f32_linear"),
                   w4a8_linear=hasattr(ops, "w4a8_linear"),
                   vnni_linear=hasattr(ops, "vnni_w8a8_linear"),
                   prefill_attention_head_dims=(
                       PREFILL_HEAD_DIMS if hasattr(ops, "paged_prefill_attention")
                       else frozenset()),
                   avx512=cpu_has_avx512f(), amx=cpu_has_amx(),
                   decode_layers=_has_class("DecodeLayers"),
                   linear_tiles=bf16 and ops.bf16_linear_uses_tiles())

    def linear(self, dtype: torch.dtype) -> bool:
        """Whether the native float, int8 (both kinds) and int4 linear kernels take ``dtype``
        activations (bfloat16: ``bf16_linear``; float32: ``f32_linear``)."""
        return ((dtype == torch.bfloat16 and self.bf16_linear)
                or (dtype == torch.float32 and self.f32_linear))

    def int8_kv_integer_scores(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the decode attention over an 8-bit KV cache (``kv_int8``) rounds each
        of its ``dtype`` query heads of ``head_dim`` to an 8-bit row too and multiplies
        them with the keys as integers (``VPDPBUSD``: with AVX512-VNNI, the same build
        condition as ``vnni_linear``, for float32 or bfloat16 heads of 64, 128 or 256);
        elsewhere it multiplies the queries as they are, in float32."""
        return (self.vnni_linear and dtype in (torch.float32, torch.bfloat16)
                and head_dim in BLOCKED_DECODE_HEAD_DIMS)

    def prefill_attention(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the prefill attention kernel computes ``dtype`` heads of ``head_dim``."""
        return dtype == torch.bfloat16 and head_dim in self.prefill_attention_head_dims


def _has_class(name: str) -> bool:
    """Whether the loaded build registers the class ``torch.classes.tokenmill.<name>``."""
    try:
        getattr(torch.classes.tokenmill, name)
    except RuntimeError:
        return False
    return True
