"""The capabilities record says what the build holds, and every choice follows it: a kernel
reported missing is never chosen, on each kind of host (AMX with its tiles granted or not,
AVX512-BF16 without AMX, AVX2 only, AVX-512 without BF16 or VNNI), whatever host the test
runs on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.hardware import cpu_flags
from tokenmill.kernels import KernelUnavailableError
from tokenmill.models.attention.native import NativeAttention, NativePrefill
from tokenmill.models.attention.sdpa import SdpaPrefill
from tokenmill.models.weights import formats as weight_formats
from tokenmill.models.weights.formats import (
    Int4Format,
    Int8Format,
    NativeFormat,
    NativeInt4Format,
    NativeInt8Format,
    NativeVnniW4A8Format,
    NativeW4A8Format,
    NativeW8A8Format,
    OneDNNFormat,
)
from tokenmill.models.weights.native_weights import NativeWeight
from tokenmill.models.weights.quantizations import choose_weight_format

CPU = torch.device("cpu")
BF16, F32 = torch.bfloat16, torch.float32
HEADS = (9, 3, 64)  # query heads, KV heads, head size
HOSTS = {
    "amx": dict(bf16_linear=True, f32_linear=True, w4a8_linear=True, vnni_linear=True,
                prefill_attention_head_dims=frozenset({64, 128}), avx512=True, amx=True,
                linear_tiles=True),
    # an AMX CPU whose operating system does not grant the tiles (Linux before 5.16)
    "amx_not_granted": dict(bf16_linear=True, f32_linear=True, w4a8_linear=True,
                            vnni_linear=True, prefill_attention_head_dims=frozenset({64, 128}),
                            avx512=True, amx=True, linear_tiles=False),
    "avx512_bf16": dict(bf16_linear=True, f32_linear=True, w4a8_linear=True, vnni_linear=True,
                        prefill_attention_head_dims=frozenset({64, 128}), avx512=True,
                        amx=False, linear_tiles=False),
    "avx2": dict(bf16_linear=False, f32_linear=True, w4a8_linear=True, vnni_linear=False,
                 prefill_attention_head_dims=frozenset(), avx512=False, amx=False,
                 linear_tiles=False),
    "avx512_no_bf16": dict(bf16_linear=False, f32_linear=True, w4a8_linear=True,
                           vnni_linear=False, prefill_attention_head_dims=frozenset(),
                           avx512=True, amx=False, linear_tiles=False),
}
# w4a8 and w8a8 where the CPU has AVX512-VNNI: either dtype, the head in w8a8
VNNI = {(dtype, quantization): (fmt, NativeW8A8Format)
        for dtype in (BF16, F32)
        for quantization, fmt in (("w4a8", NativeVnniW4A8Format), ("w8a8", NativeW8A8Format))}
# (dtype, quantization) -> (format, its head's format) on each kind of host; oneDNN can
# reorder every dtype here (an AVX2-only CPU cannot for bfloat16: see test_weight_formats)
EXPECTED = {
    "amx": {(BF16, "none"): (NativeFormat, NativeFormat),
            (F32, "none"): (OneDNNFormat, OneDNNFormat),
            (BF16, "int8"): (NativeInt8Format, NativeInt8Format),
            (BF16, "int4"): (NativeInt4Format, NativeInt8Format),
            (F32, "int8"): (Int8Format, Int8Format),
            (F32, "int4"): (Int4Format, Int8Format),
            **VNNI},
    "amx_not_granted": {(BF16, "none"): (OneDNNFormat, OneDNNFormat),
            (F32, "none"): (OneDNNFormat, OneDNNFormat),
            (BF16, "int8"): (NativeInt8Format, NativeInt8Format),
            (BF16, "int4"): (NativeInt4Format, NativeInt8Format),
            (F32, "int8"): (Int8Format, Int8Format),
            (F32, "int4"): (Int4Format, Int8Format),
            **VNNI},
    "avx512_bf16": {(BF16, "none"): (NativeFormat, NativeFormat),
                    (F32, "none"): (OneDNNFormat, OneDNNFormat),
                    (BF16, "int8"): (NativeInt8Format, NativeInt8Format),
                    (BF16, "int4"): (NativeInt4Format, NativeInt8Format),
                    (F32, "int8"): (Int8Format, Int8Format),
                    (F32, "int4"): (Int4Format, Int8Format),
                    **VNNI},
    "avx2": {(BF16, "none"): (OneDNNFormat, OneDNNFormat),
             (F32, "none"): (NativeFormat, NativeFormat),
             (BF16, "int8"): (Int8Format, Int8Format),
             (BF16, "int4"): (Int4Format, Int8Format),
             (F32, "int8"): (NativeInt8Format, NativeInt8Format),
             (F32, "int4"): (NativeInt4Format, NativeInt8Format),
             (F32, "w4a8"): (NativeW4A8Format, NativeInt8Format)},
    "avx512_no_bf16": {(BF16, "none"): (OneDNNFormat, OneDNNFormat),
                       (F32, "none"): (OneDNNFormat, OneDNNFormat),
                       (BF16, "int8"): (Int8Format, Int8Format),
                       (BF16, "int4"): (Int4Format, Int8Format),
                       (F32, "int8"): (Int8Format, Int8Format),
                       (F32, "int4"): (Int4Format, Int8Format),
                       (F32, "w4a8"): (NativeW4A8Format, Int8Format)},
}


def with_capabilities(native, **changes):
    """``native`` as a build whose capabilities differ by ``changes``."""
    return dataclasses.replace(
        native, capabilities=dataclasses.replace(native.capabilities, **changes))


def test_capabilities_match_the_cpu_flags(native):
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags here")
    caps = native.capabilities
    assert caps.bf16_linear == ({"avx512_bf16", "avx512bw"} <= flags)
    assert caps.f32_linear == ({"avx2", "fma"} <= flags)  # on AVX-512 CPUs too
    assert caps.avx512 == ("avx512f" in flags)
    assert caps.w4a8_linear == ({"avx2", "fma", "f16c"} <= flags)
    assert caps.vnni_linear == ({"avx512_vnni", "avx512bw", "f16c"} <= flags)
    assert caps.prefill_attention_head_dims == (frozenset({64, 128, 256}) if caps.bf16_linear
                                                else frozenset())
    assert caps.amx == ("amx_bf16" in flags)
    # granted by the operating system on every Linux since 5.16
    assert caps.linear_tiles == (caps.bf16_linear and {"amx_bf16", "amx_tile"} <= flags)
    assert caps.linear(BF16) == caps.bf16_linear and caps.linear(F32) == caps.f32_linear
    assert not caps.linear(torch.float16)


@pytest.mark.parametrize("host", list(HOSTS))
def test_weight_format_follows_the_capabilities(native, host, monkeypatch):
    monkeypatch.setattr(weight_formats, "onednn_supports", lambda dtype: True)
    kernels = with_capabilities(native, **HOSTS[host])
    for (dtype, quantization), (fmt, head) in EXPECTED[host].items():
        chosen = choose_weight_format(dtype, CPU, quantization, kernels)
        assert type(chosen) is fmt, (dtype, quantization)
        assert type(chosen.head) is head, (dtype, quantization)


def test_without_native_kernels_pytorch_formats_are_chosen(monkeypatch):
    monkeypatch.setattr(weight_formats, "onednn_supports", lambda dtype: True)
    for dtype in (BF16, F32):
        assert type(choose_weight_format(dtype, CPU)) is OneDNNFormat
        assert type(choose_weight_format(dtype, CPU, "int8")) is Int8Format
        assert type(choose_weight_format(dtype, CPU, "int4").head) is Int8Format
    assert choose_weight_format(BF16, torch.device("cuda")) is None
    with pytest.raises(ValueError, match="AVX2, FMA and F16C"):
        choose_weight_format(F32, CPU, "w4a8")


def test_every_capability_off_leaves_no_native_format(native, monkeypatch):
    monkeypatch.setattr(weight_formats, "onednn_supports", lambda dtype: True)
    kernels = with_capabilities(native, bf16_linear=False, f32_linear=False, w4a8_linear=False,
                                vnni_linear=False, prefill_attention_head_dims=frozenset())
    for dtype in (BF16, F32):
        for quantization in ("none", "int8", "int4"):
            chosen = choose_weight_format(dtype, CPU, quantization, kernels)
            assert type(chosen) in (OneDNNFormat, Int8Format, Int4Format)
            assert type(chosen.head) in (OneDNNFormat, Int8Format)
    with pytest.raises(ValueError, match="AVX2, FMA and F16C"):
        choose_weight_format(F32, CPU, "w4a8", kernels)
    with pytest.raises(ValueError, match="AVX512-VNNI"):
        choose_weight_format(BF16, CPU, "w8a8", kernels)


def test_w4a8_in_bfloat16_needs_vnni(native):
    """Without AVX512-VNNI, w4a8's kernel takes float32 activations only: bfloat16 is refused
    with the way out, not computed another way."""
    avx2 = with_capabilities(native, **HOSTS["avx2"])
    with pytest.raises(ValueError, match="float32 activations"):
        choose_weight_format(BF16, CPU, "w4a8", avx2)
    with pytest.raises(ValueError, match="AVX512-VNNI"):
        choose_weight_format(F32, CPU, "w8a8", avx2)


def test_prefill_attention_follows_the_capabilities(native):
    """The native attention backend takes the prefill kernel only for the dtype and head
    sizes the build has it for, and not where the CPU has AMX (SDPA's AMX tiles prefill
    faster there); SDPA otherwise."""
    without = with_capabilities(native, prefill_attention_head_dims=frozenset())
    assert type(NativeAttention(without, *HEADS, BF16).prefill) is SdpaPrefill
    assert type(NativeAttention(native, *HEADS, F32).prefill) is SdpaPrefill
    assert type(NativeAttention(native, 4, 2, 80, BF16).prefill) is SdpaPrefill
    with_amx = with_capabilities(native, amx=True)
    assert type(NativeAttention(with_amx, *HEADS, BF16).prefill) is SdpaPrefill
    no_amx = with_capabilities(native, amx=False)
    expected = NativePrefill if native.capabilities.prefill_attention(BF16, 64) else SdpaPrefill
    assert type(NativeAttention(no_amx, *HEADS, BF16).prefill) is expected


def test_a_missing_kernel_is_refused_not_called(native):
    """Asking for a kernel the capabilities deny raises at once (at build time), instead
    of failing in the middle of a forward pass."""
    none = with_capabilities(native, bf16_linear=False, f32_linear=False, w4a8_linear=False,
                             vnni_linear=False, prefill_attention_head_dims=frozenset())
    for dtype in (BF16, F32, torch.float16):
        with pytest.raises(KernelUnavailableError):
            none.linear_kernels(dtype)
        with pytest.raises(KernelUnavailableError):
            NativeWeight(none, torch.zeros(32, 64, dtype=dtype), None)
    with pytest.raises(KernelUnavailableError):
        none.w4a8_linear()
    with pytest.raises(KernelUnavailableError):
        none.vnni_linear()
    with pytest.raises(KernelUnavailableError):
        none.prefill_attention(BF16, 64)
