"""Weight formats on CPU: each packed form computes what plain ``F.linear`` does, within its
precision, and the host's support decides which one a model gets."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import write_gguf
from paged_runner import PagedRunner
from safetensors.torch import load_file

from tokenmill.config import EngineConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.models.config import ModelConfig
from tokenmill.models.families.llama import LlamaForCausalLM
from tokenmill.models.layers.linear import Linear
from tokenmill.models.loader import load_model
from tokenmill.models.perplexity import perplexity
from tokenmill.models.registry import HF_FAMILIES
from tokenmill.models.weights import formats as weight_formats
from tokenmill.models.weights.formats import GGUFFormat, Int4Format, NativeInt4Format
from tokenmill.models.weights.native_weights import (
    NativeInt4Weight,
    NativeInt8Weight,
    NativeVnniW4A8Weight,
    NativeW4A8Weight,
    NativeW8A8Weight,
    NativeWeight,
)
from tokenmill.models.weights.quantizations import (
    QUANTIZATIONS,
    check_source,
    choose_weight_format,
    resolve_dtype,
    resolve_quantization,
)
from tokenmill.models.weights.torch_weights import (
    Int4Weight,
    Int8Weight,
    OneDNNWeight,
    onednn_supports,
)
from tokenmill.quantization_names import QUANTIZATION_CHOICES, QUANTIZATION_OPTIONS
from tokenmill.tokenizer.tokenizer import load_tokenizer

CPU = torch.device("cpu")
BF16 = torch.bfloat16
TEXT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "public_domain.txt")


def unpacked_model(model_dir: str, dtype: torch.dtype) -> LlamaForCausalLM:
    with open(os.path.join(model_dir, "config.json")) as f:
        model = LlamaForCausalLM(ModelConfig.from_hf_dict(json.load(f), HF_FAMILIES), dtype, CPU)
    for file in glob.glob(os.path.join(model_dir, "*.safetensors")):
        model.load_weights(load_file(file).items())
    return model


def mixed_batch_logits(model) -> torch.Tensor:
    runner = PagedRunner(model, block_size=4)
    runner.step([(0, list(range(30, 60))), (1, list(range(100, 105)))])
    return runner.step([(0, [7]), (1, list(range(200, 220))), (2, [9, 10, 11])])


def packed_formats(model) -> set[type]:
    formats = {type(m.packed) for m in model.modules() if isinstance(m, Linear)}
    if model.lm_head is None:
        formats.add(type(model.packed_tied_head))
    return formats


@pytest.mark.parametrize("variant", ["llama", "llama_untied", "qwen2"])
def test_onednn_bf16_matches_plain_bf16(tiny_model_dir, variant):
    if not onednn_supports(BF16):
        pytest.skip("oneDNN cannot reorder bfloat16 weights on this CPU "
                    "(it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)")
    model_dir = tiny_model_dir(variant)
    packed, _ = load_model(model_dir, BF16, CPU)
    assert packed_formats(packed) == {OneDNNWeight}

    got = mixed_batch_logits(packed)
    plain = mixed_batch_logits(unpacked_model(model_dir, BF16))
    reference = mixed_batch_logits(unpacked_model(model_dir, torch.float32))
    torch.testing.assert_close(got, plain, atol=0.02, rtol=0.02)
    torch.testing.assert_close(got, reference, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("variant", ["llama", "llama_untied", "qwen2"])
def test_native_bf16_matches_plain_bf16(tiny_model_dir, variant, native):
    if not native.capabilities.bf16_linear:
        pytest.skip("this CPU has no AVX512-BF16: the native bfloat16 kernel is not built")
    without_amx = dataclasses.replace(  # (AMX without its tiles granted keeps oneDNN)
        native, capabilities=dataclasses.replace(native.capabilities, amx=False))
    model_dir = tiny_model_dir(variant)
    packed, _ = load_model(model_dir, BF16, CPU, kernels=without_amx)
    assert packed_formats(packed) == {NativeWeight}

    got = mixed_batch_logits(packed).float()
    plain = mixed_batch_logits(unpacked_model(model_dir, BF16)).float()
    reference = mixed_batch_logits(unpacked_model(model_dir, torch.float32))
    torch.testing.assert_close(got, reference, atol=0.1, rtol=0.05)
    # as precise as PyTorch's own bfloat16 (the two round in different places, so they
    # differ from each other by about as much as each differs from float32)
    assert (got - reference).abs().mean() <= 1.25 * (plain - reference).abs().mean()


@pytest.mark.parametrize("variant", ["llama", "llama_untied", "qwen2"])
def test_native_float32_matches_plain_float32(tiny_model_dir, variant, native):
    if not native.capabilities.f32_linear:
        pytest.skip("this CPU lacks AVX2 or FMA: it has no native float32 kernels")
    model_dir = tiny_model_dir(variant)
    # native formats alone: on an AVX-512 CPU float32 takes oneDNN's otherwise
    packed, _ = load_model(model_dir, torch.float32, CPU, kernels=native, batch_invariant=True)
    assert packed_formats(packed) == {NativeWeight}
    torch.testing.assert_close(mixed_batch_logits(packed),
                               mixed_batch_logits(unpacked_model(model_dir, torch.float32)),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_onednn_float32_matches_plain_float32(tiny_model_dir, variant):
    if not onednn_supports(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    model_dir = tiny_model_dir(variant)
    packed, _ = load_model(model_dir, torch.float32, CPU)
    assert packed_formats(packed) == {OneDNNWeight}
    torch.testing.assert_close(mixed_batch_logits(packed),
                               mixed_batch_logits(unpacked_model(model_dir, torch.float32)),
                               atol=1e-4, rtol=1e-4)


def native_for(kernels: str, dtype: torch.dtype, request):
    """The native kernels for a ``kernels`` parametrization (None: PyTorch's); skips where
    this CPU has no native linear kernels for ``dtype``. A model loads with them alone
    (``batch_invariant``), also where PyTorch's are the faster choice (float32 on
    AVX-512)."""
    if kernels == "torch":
        return None
    native = request.getfixturevalue("native")
    if not native.capabilities.linear(dtype):
        pytest.skip(f"this CPU has no native linear kernels for {dtype}: PyTorch's run")
    return native


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("variant", ["llama", "llama_untied", "qwen2"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_int8_weights_match_float32_within_quantization_error(tiny_model_dir, variant, kernels,
                                                              dtype, request):
    native = native_for(kernels, dtype, request)
    model_dir = tiny_model_dir(variant)
    quantized, _ = load_model(model_dir, dtype, CPU, "int8", native,
                              batch_invariant=native is not None)
    assert packed_formats(quantized) == {NativeInt8Weight if native else Int8Weight}
    got = mixed_batch_logits(quantized).float()
    reference = mixed_batch_logits(unpacked_model(model_dir, torch.float32))
    torch.testing.assert_close(got, reference, atol=0.15, rtol=0.05)


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("variant", ["llama", "llama_untied", "qwen2"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_int4_weights_match_float32_within_quantization_error(tiny_model_dir, variant, kernels,
                                                              dtype, request):
    native = native_for(kernels, dtype, request)
    model_dir = tiny_model_dir(variant)
    quantized, _ = load_model(model_dir, dtype, CPU, "int4", native,
                              batch_invariant=native is not None)
    # the head keeps 8 bits
    assert packed_formats(quantized) == ({NativeInt4Weight, NativeInt8Weight} if native
                                         else {Int4Weight, Int8Weight})
    got = mixed_batch_logits(quantized).float()
    reference = mixed_batch_logits(unpacked_model(model_dir, torch.float32))
    # 4 bits on random weights: a coarse bound, far below what a wrong kernel gives
    torch.testing.assert_close(got, reference, atol=0.8, rtol=0.1)


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_int4_recovers_the_4_bit_values_of_q4_1_blocks(kernels, dtype, request):
    """Weights dequantized from GGUF Q4_1 blocks (fp16 scale d and minimum m per 32 inputs,
    w = d * q + m) come back as the same q: PyTorch's kernel in bfloat16 rounds d and m to
    bfloat16, the native kernels and float32 keep them."""
    native = native_for(kernels, dtype, request)
    gen = torch.Generator().manual_seed(0)
    out_features, in_features = 48, 96
    groups = in_features // Int4Weight.GROUP
    q = torch.randint(0, 16, (out_features, groups, Int4Weight.GROUP), generator=gen)
    q[..., 0], q[..., 1] = 0, 15  # a Q4_1 block maps its minimum to 0 and maximum to 15
    d = (torch.rand(out_features, groups, 1, generator=gen) * 0.02 + 0.001).half().float()
    # a block's minimum is about -7.5 steps: its weights straddle 0
    m = (-7.5 * d + torch.randn(out_features, groups, 1, generator=gen) * d).half().float()
    weight = (d * q + m).view(out_features, in_features)
    fmt = Int4Format() if native is None else NativeInt4Format(native)
    packed = fmt.pack(weight.to(dtype), None)
    dequantized = packed(torch.eye(in_features, dtype=dtype)).float().t()
    step = d.expand(-1, -1, Int4Weight.GROUP).reshape(out_features, in_features)
    assert ((dequantized - weight).abs() / step).max() < 0.1  # bfloat16 rounding, not a step


@pytest.mark.parametrize("variant", ["llama", "llama_untied", "qwen2"])
def test_w4a8_matches_float32_within_quantization_error(tiny_model_dir, variant, native):
    caps = native.capabilities
    if not (caps.w4a8_linear or caps.vnni_linear):
        pytest.skip("the w4a8 kernels need a CPU with AVX2, FMA and F16C, or AVX512-VNNI")
    model_dir = tiny_model_dir(variant)
    quantized, _ = load_model(model_dir, torch.float32, CPU, "w4a8", native)
    # the output head in 8 bits: w8a8 with VNNI, else int8 weights, float32 activations
    if caps.vnni_linear:
        expected = {NativeVnniW4A8Weight, NativeW8A8Weight}
    else:
        native_head = caps.f32_linear and not caps.avx512  # else oneDNN's is the faster
        expected = {NativeW4A8Weight, NativeInt8Weight if native_head else Int8Weight}
    assert packed_formats(quantized) == expected
    got = mixed_batch_logits(quantized)
    reference = mixed_batch_logits(unpacked_model(model_dir, torch.float32))
    # int4's bound: 8-bit activations add little to the 4-bit weights' error
    torch.testing.assert_close(got, reference, atol=0.8, rtol=0.1)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_w8a8_matches_float32_within_quantization_error(tiny_model_dir, variant, dtype,
                                                        native):
    if not native.capabilities.vnni_linear:
        pytest.skip("the w8a8 kernel needs a CPU with AVX512-VNNI")
    model_dir = tiny_model_dir(variant)
    quantized, _ = load_model(model_dir, dtype, CPU, "w8a8", native)
    assert packed_formats(quantized) == {NativeW8A8Weight}  # the output head too
    got = mixed_batch_logits(quantized).float()
    reference = mixed_batch_logits(unpacked_model(model_dir, torch.float32))
    # int8's bound, and bfloat16's where the activations are bfloat16
    torch.testing.assert_close(got, reference, atol=0.3, rtol=0.05)


def test_w4a8_runs_only_as_its_native_kernels(native):
    without = dataclasses.replace(native, capabilities=dataclasses.replace(
        native.capabilities, w4a8_linear=False, vnni_linear=False))
    with pytest.raises(InvalidParameterError, match="AVX2, FMA and F16C") as info:
        choose_weight_format(torch.float32, CPU, "w4a8", without)
    assert info.value.param == "quantization"
    avx2_only = dataclasses.replace(native, capabilities=dataclasses.replace(
        native.capabilities, w4a8_linear=True, vnni_linear=False))
    for dtype in (BF16, torch.float16):
        with pytest.raises(InvalidParameterError, match="float32 activations"):
            choose_weight_format(dtype, CPU, "w4a8", avx2_only)
    with pytest.raises(InvalidParameterError, match="AVX512-VNNI"):
        choose_weight_format(torch.float32, CPU, "w8a8", avx2_only)
    for quantization in ("w4a8", "w8a8"):
        with pytest.raises(InvalidParameterError, match="CPU only"):
            choose_weight_format(torch.float32, torch.device("cuda"), quantization, native)
    with pytest.raises(InvalidParameterError, match="use int8"):
        NativeW4A8Weight(native, torch.zeros(16, 48), None)


def test_int4_rejects_shapes_its_kernel_cannot_pack(native):
    with pytest.raises(InvalidParameterError, match="use int8"):
        Int4Weight(torch.zeros(16, 48), None)  # 48 inputs: not a multiple of 32
    with pytest.raises(InvalidParameterError, match="use int8"):
        Int4Weight(torch.zeros(24, 64), None)  # 24 outputs: not a multiple of 16
    if native.capabilities.bf16_linear:
        with pytest.raises(InvalidParameterError, match="use int8"):
            NativeInt4Weight(native, torch.zeros(16, 48, dtype=BF16), None)
        assert NativeInt4Weight(native, torch.zeros(24, 64, dtype=BF16), None).packed.shape[0] == 1
    if native.capabilities.f32_linear:
        with pytest.raises(InvalidParameterError, match="use int8"):
            NativeInt4Weight(native, torch.zeros(16, 48), None)
        assert NativeInt4Weight(native, torch.zeros(24, 64), None).packed.shape[0] == 2


def test_without_onednn_support_weights_stay_plain(tiny_model_dir, monkeypatch):
    """An AVX2-only host cannot reorder bfloat16 for oneDNN: the model must still load."""
    monkeypatch.setattr(weight_formats, "onednn_supports", lambda dtype: False)
    assert choose_weight_format(BF16, CPU) is None
    model, _ = load_model(tiny_model_dir("llama"), BF16, CPU)
    assert packed_formats(model) == {type(None)}
    assert torch.isfinite(mixed_batch_logits(model)).all()


@pytest.mark.parametrize("dtype,device,message", [
    (torch.float16, CPU, "takes bfloat16 or float32 activations"),
    (BF16, torch.device("cuda"), "CPU only"),
])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_rejects_what_it_cannot_run(dtype, device, message, quantization):
    with pytest.raises(InvalidParameterError, match=message) as info:
        choose_weight_format(dtype, device, quantization)
    assert info.value.param == "quantization"


@pytest.mark.slow
def test_quantized_perplexity_of_smollm2_within_two_percent(native):
    """The accuracy int8, int4, w4a8, w8a8 and gguf (the file's own Q4_1 blocks) cost,
    bounded: the embedded model on a fixed public-domain text, computed as the engine
    computes it (the dtype ``auto`` picks here, float32 for w4a8 without AVX512-VNNI;
    native kernels where they run)."""
    with open(TEXT, encoding="utf-8") as f:
        token_ids = load_tokenizer(None).encode(f.read())
    assert len(token_ids) > 500
    exact = perplexity(load_model(None, torch.float32, CPU)[0], token_ids)
    assert 5 < exact < 20  # the model reads English: a sanity bound on the measure itself
    caps = native.capabilities
    for quantization in ("int8", "int4", "w4a8", "w8a8", "gguf"):
        if quantization == "w4a8" and not (caps.w4a8_linear or caps.vnni_linear):
            continue  # its kernels need AVX2 and FMA, or AVX512-VNNI
        if quantization == "w8a8" and not caps.vnni_linear:
            continue
        dtype = resolve_dtype("auto", CPU, quantization)
        if quantization == "gguf" and not GGUFFormat.supports(dtype, native):
            continue  # the native int4 kernel of the dtype
        model = load_model(None, dtype, CPU, quantization, native)[0]
        quantized = perplexity(model, token_ids)
        assert quantized <= exact * 1.02, (
            f"{quantization} perplexity {quantized:.3f} vs {exact:.3f}")


def test_the_table_of_quantizations_decides_the_options_choices():
    """``--quantization`` offers ``auto`` and the table's rows, in order; a row of a GGUF
    file's own blocks refuses a folder, naming the rows that take one."""
    assert tuple(QUANTIZATIONS) == QUANTIZATION_CHOICES
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(EngineConfig)}
    assert choices["quantization"] == QUANTIZATION_OPTIONS
    for row in QUANTIZATIONS.values():
        if row.file_blocks:
            with pytest.raises(InvalidParameterError, match="none, int8, int4, w4a8 or w8a8"):
                check_source(row.name, "folder", is_folder=True)
        check_source(row.name, "model.gguf", is_folder=False)


def test_auto_quantization_computes_a_quantized_gguf_file_on_its_blocks(tmp_path, native,
                                                                        tiny_model_dir):
    """``--quantization auto`` (the default) is ``gguf`` for a GGUF file storing quantized
    matrices where the host runs it, and ``none`` for a float GGUF file and a folder, and
    under ``batch_invariant``; a named quantization is itself."""
    device, kernels = CPU, native
    hf_dir = tiny_model_dir("llama")
    quantized, float16 = str(tmp_path / "q.gguf"), str(tmp_path / "f16.gguf")
    write_gguf(hf_dir, quantized, Q.Q8_0)
    write_gguf(hf_dir, float16, Q.F16)
    runs = GGUFFormat.supports(resolve_dtype("auto", device, "gguf"), kernels)
    assert resolve_quantization("auto", quantized, "auto", device, kernels) == (
        "gguf" if runs else "none")
    assert resolve_quantization("auto", float16, "auto", device, kernels) == "none"
    assert resolve_quantization("auto", str(hf_dir), "auto", device, kernels) == "none"
    assert resolve_quantization("auto", quantized, "auto", device, kernels,
                                batch_invariant=True) == "none"
    assert resolve_quantization("int8", quantized, "auto", device, kernels) == "int8"
