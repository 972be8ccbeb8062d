"""The one handle on the compiled kernels: ``NativeKernels``, and the engine's choice of it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import tokenmill.kernels.signatures as sig
from tokenmill.errors import InvalidParameterError
from tokenmill.kernels.build import load_library
from tokenmill.kernels.capabilities import KernelCapabilities


class KernelUnavailableError(RuntimeError):
    """A kernel asked for where ``KernelCapabilities`` says this build has none."""


@dataclass(frozen=True, slots=True)
class LinearKernels:
    """The native linear kernels for one activation dtype (bfloat16 or float32): plain,
    int8 (a scale per output row, or per 16 or 32 inputs of a row: the same packing) and
    int4 weights."""

    pack_weight: sig.PackWeight
    linear: sig.FloatLinear
    int8_pack_weight: sig.PackWeight
    int8_linear: sig.Int8Linear
    int8_group_linear: sig.Int8GroupLinear
    int4_linear: sig.Int4Linear


@dataclass(frozen=True, slots=True)
class VnniLinearKernels:
    """The linear kernels over int8 or 4-bit weights times activations quantized to int8
    (AVX512-VNNI), for bfloat16 or float32 activations alike: quantized here (w8a8, w4a8;
    w4a8 also a GGUF file's Q4_0 and Q4_1 blocks) or a GGUF file's own blocks (q4_k, q8_0,
    q6_k); and ``dequantize``, the dense bfloat16 weight a packed one of w4a8 or of a
    file's kind holds."""

    w8a8: sig.W8A8Linear
    w4a8: sig.W4A8Linear
    q4_k: sig.GGUFBlocksLinear
    q8_0: sig.GGUFBlocksLinear
    q6_k: sig.GGUFBlocksLinear
    dequantize: sig.VnniDequantize


@dataclass(frozen=True, slots=True)
class NativeKernels:
    """The compiled kernels of this CPU. The fields are the ops every build has, bound once
    here (callers keep and call them directly); the CPU-dependent kernels come from the
    methods, each of which raises ``KernelUnavailableError`` where ``capabilities`` says
    this build lacks it. Made by ``native_kernels()``, once per process."""

    capabilities: KernelCapabilities
    rms_norm: sig.RmsNorm
    silu_and_mul: sig.SiluAndMul
    rotary_store_kv: sig.RotaryStoreKV
    paged_decode_attention: sig.PagedDecodeAttention
    dequantize_kv_blocks: sig.DequantizeKVBlocks
    argmax_rows: sig.ArgmaxRows
    sample_rows: sig.SampleRows
    logprob_rows: sig.LogprobRows

    def linear_kernels(self, dtype: torch.dtype) -> LinearKernels:
        """The linear kernels for ``dtype`` activations (``capabilities.linear(dtype)``)."""
        _require(self.capabilities.linear(dtype), f"native linear kernels for {dtype}")
        ops = torch.ops.tokenmill
        if dtype == torch.bfloat16:
            return LinearKernels(ops.bf16_pack_weight, ops.bf16_linear, ops.int8_pack_weight,
                                 ops.int8_linear, ops.int8_group_linear, ops.int4_linear)
        return LinearKernels(ops.f32_pack_weight, ops.f32_linear, ops.int8_f32_pack_weight,
                             ops.int8_f32_linear, ops.int8_group_f32_linear,
                             ops.int4_f32_linear)

    def w4a8_linear(self) -> sig.W4A8Linear:
        """The w4a8 linear kernel (``capabilities.w4a8_linear``)."""
        _require(self.capabilities.w4a8_linear, "the w4a8 linear kernel")
        return torch.ops.tokenmill.w4a8_linear

    def vnni_linear(self) -> VnniLinearKernels:
        """The integer-activation kernels of a CPU with AVX512-VNNI (``capabilities.
        vnni_linear``)."""
        _require(self.capabilities.vnni_linear, "the AVX512-VNNI linear kernels")
        ops = torch.ops.tokenmill
        return VnniLinearKernels(ops.vnni_w8a8_linear, ops.vnni_w4a8_linear,
                                 ops.vnni_q4_k_linear, ops.vnni_q8_0_linear,
                                 ops.vnni_q6_k_linear, ops.vnni_dequantize)

    def decode_layers(self, eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
                      scale: float, window: int) -> sig.DecodeLayers:
        """An empty ``DecodeLayers`` stack (``capabilities.decode_layers``) for layers of
        RMSNorm ``eps`` and attention of ``num_heads`` query and ``num_kv_heads`` KV heads of
        ``head_dim``, scaled by ``scale``, over the last ``window`` keys (0: all); its decode
        rows split between threads from ``split_rows_per_thread`` rows a thread."""
        _require(self.capabilities.decode_layers, "the fused decode layers")
        return torch.classes.tokenmill.DecodeLayers(
            eps, num_heads, num_kv_heads, head_dim, scale, window,
            split_rows_per_thread(self.capabilities))

    def prefill_attention(self, dtype: torch.dtype, head_dim: int) -> sig.PagedPrefillAttention:
        """The prefill attention kernel, for ``dtype`` heads of ``head_dim``
        (``capabilities.prefill_attention(dtype, head_dim)``)."""
        _require(self.capabilities.prefill_attention(dtype, head_dim),
                 f"prefill attention for {dtype} heads of {head_dim}")
        return torch.ops.tokenmill.paged_prefill_attention


def split_rows_per_thread(capabilities: KernelCapabilities) -> int:
    """Decode rows a thread needs before ``DecodeLayers`` gives each thread its own share
    of the sequences (0: never). Each thread then reads every weight itself, so a share
    pays only where its rows' products take longer than reading the weights: 16 a thread
    where the linear kernels multiply with AVX-512 or AVX2 (on a Zen 4 host, 8 a thread was
    2-8% slower than no split at 16 sequences, 16 a thread 1-10% faster at 32 and 64);
    never where they multiply on AMX tiles, several times faster a row (not measured)."""
    return 0 if capabilities.linear_tiles else 16


def _require(available: bool, what: str) -> None:
    if not available:
        raise KernelUnavailableError(f"this build of the native kernels has no {what}")


@functools.cache
def native_kernels() -> NativeKernels | None:
    """This CPU's kernels, loaded on first use; None where they cannot be loaded here (the
    log says why)."""
    if not load_library():
        return None
    ops = torch.ops.tokenmill
    return NativeKernels(
        capabilities=KernelCapabilities.of_loaded_library(), rms_norm=ops.rms_norm,
        silu_and_mul=ops.silu_and_mul, rotary_store_kv=ops.rotary_store_kv,
        paged_decode_attention=ops.paged_decode_attention,
        dequantize_kv_blocks=ops.dequantize_kv_blocks, argmax_rows=ops.argmax_rows,
        sample_rows=ops.sample_rows, logprob_rows=ops.logprob_rows)


def choose_kernels(choice: str, device: torch.device) -> NativeKernels | None:
    """The native kernels for the ``kernels`` option (``auto | native | torch``) on
    ``device``; None: PyTorch's. ``auto`` takes them on a CPU where they build.
    Raises ``InvalidParameterError`` when ``native`` is asked for and cannot run."""
    if choice == "torch" or (choice == "auto" and device.type != "cpu"):
        return None
    if device.type != "cpu":
        raise InvalidParameterError("kernels native runs on the CPU only", "kernels")
    kernels = native_kernels()
    if kernels is None and choice == "native":
        raise InvalidParameterError("the native kernels could not be built on this host (see "
                                    "the log); use kernels torch", "kernels")
    return kernels
