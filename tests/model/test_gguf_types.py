"""GGUF tensor types: every supported type loads bit for bit as the gguf package's reference
dequantization computes it; ``--quantization gguf`` computes on the file's own blocks
(as 4-bit planes) exactly; a file with an unsupported type, or truncated, fails with one
clear ModelLoadError.

The files are written here, offline: tensors of the types the gguf package cannot
quantize (and, to cover every bit pattern, all the others too) are random valid blocks.
"""

from __future__ import annotations

import os
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf_writer import random_blocks, write_gguf
from paged_runner import PagedRunner
from transformers import AutoModelForCausalLM

from tokenmill.errors import InvalidParameterError, ModelLoadError
from tokenmill.kernels.linear import NativeInt4PlanesWeight, NativeInt4Weight
from tokenmill.models.gguf_blocks import PLANE_TYPES, SUPPORTED_TYPES, FileRows
from tokenmill.models.gguf_loader import open_gguf
from tokenmill.models.loader import load_model
from tokenmill.models.weight_formats import GGUFFormat, StackedRowsWeight, choose_weight_format

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_model import make_tiny_model_dir  # noqa: E402

CPU = torch.device("cpu")
BF16 = torch.bfloat16
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
         Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
PROMPT = [4, 150, 23, 77, 310, 12, 9, 260, 45, 101, 33, 7, 88, 199, 5, 64, 2, 71]


@pytest.fixture(scope="module")
def k_model_dir(tmp_path_factory):
    """A tiny llama whose every projection has a multiple of 256 inputs (a K-quant
    super-block) and an untied output head."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("k_llama"), "llama", hidden_size=256,
                               intermediate_size=512, tie_word_embeddings=False)


def test_the_supported_types_are_at_least_these():
    assert set(TYPES) <= set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_every_type_loads_bit_for_bit(k_model_dir, tmp_path, qtype):
    """Each weight equals ``gguf.quants.dequantize`` of the file's bytes (Q/K rows back in
    Hugging Face's order), in float32, bit for bit; so do the rows kept for
    ``--quantization gguf``."""
    path = str(tmp_path / "m.gguf")
    stored = write_gguf(k_model_dir, path, qtype, random=True)
    _, weights = open_gguf(path)
    weights = dict(weights)
    assert weights.keys() == stored.keys()
    for name, expected in stored.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], expected), name
    _, kept = open_gguf(path, keep_blocks=True)
    for name, rows in kept:
        if isinstance(rows, FileRows):
            assert rows.qtype == qtype
            assert torch.equal(rows.dequantize(), stored[name]), name


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_k_quant_model_matches_hf_with_the_stored_weights(k_model_dir, tmp_path, qtype):
    """A whole model of the type computes what Hugging Face's does with the same weights."""
    path = str(tmp_path / "m.gguf")
    stored = write_gguf(k_model_dir, path, qtype, random=True)
    ours, _ = load_model(path, torch.float32, CPU)
    ref = AutoModelForCausalLM.from_pretrained(k_model_dir, dtype=torch.float32).eval()
    ref.load_state_dict(stored, strict=False)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def plane_values(planes, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum over the planes of q * scale + min, computed in ``dtype``."""
    total = torch.zeros(rows, cols, dtype=dtype)
    for q, scales, mins in planes:
        value = q.to(dtype).view(rows, -1, 32) * scales.to(dtype)[..., None]
        total += (value + mins.to(dtype)[..., None]).view(rows, cols)
    return total


@pytest.mark.parametrize("qtype", PLANE_TYPES, ids=lambda q: q.name)
def test_4_bit_planes_reproduce_the_reference_dequantization(qtype):
    """Q4_0, Q4_1, Q4_K (one plane: Q4_K's 6-bit sub-scales and minimums expanded) and
    Q5_0, Q5_1, Q5_K, Q8_0 (two) as a scale and a minimum per 32 inputs: the sum of
    q * scale + min is the reference, bit for bit in float32, or for Q5_1 and Q5_K the
    exact value that the reference rounds once to float32."""
    rows = FileRows(qtype, random_blocks(qtype, 24, 512, np.random.default_rng(1), 0.05), 512)
    planes = rows.int4_planes()
    assert len(planes) == (1 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else 2)
    for q, scales, mins in planes:
        assert q.dtype == torch.uint8 and int(q.max()) <= 15
        assert scales.shape == mins.shape == (24, 512 // 32)
        assert scales.dtype == mins.dtype == torch.float32
    reference = torch.from_numpy(dequantize(rows.data, qtype).reshape(24, 512))
    if qtype in (Q.Q5_1, Q.Q5_K):
        exact = plane_values(planes, 24, 512, torch.float64)
        assert torch.isclose(exact, reference.double(), rtol=2.0**-24, atol=0).all()
    else:
        assert torch.equal(plane_values(planes, 24, 512, torch.float32), reference)


def one_rounding_bound(exact: torch.Tensor, k: int) -> torch.Tensor:
    """One bfloat16 rounding of the exact result, plus float32 summation error."""
    return exact.abs() * 2.0**-8 + k * 2.0**-22 * exact.abs().max()


@pytest.mark.parametrize("qtype", PLANE_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("batch", [1, 9])
def test_int4_kernel_on_file_planes_matches_the_reference_matmul(native, qtype, batch):
    """``GGUFFormat`` puts a file's planes on the int4 kernel, which computes x @ W.T + b
    for W the reference dequantization, within the kernel's own arithmetic (one bfloat16
    rounding)."""
    if not GGUFFormat.supports(BF16, native):
        pytest.skip("this CPU has no bfloat16 native int4 kernel")
    out_features, in_features = 40, 512
    rng = np.random.default_rng(2)
    rows = FileRows(qtype, random_blocks(qtype, out_features, in_features, rng, 0.05),
                    in_features)
    reference = rows.dequantize()
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(out_features, generator=gen).to(BF16)
    fmt = choose_weight_format(BF16, CPU, "gguf", native)
    packed = fmt.pack_rows(reference.to(BF16), bias, [rows])
    kind = NativeInt4Weight if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else NativeInt4PlanesWeight
    assert type(packed) is kind
    x = torch.randn(batch, in_features, generator=gen).to(BF16)
    residual = torch.randn(batch, out_features, generator=gen).to(BF16)
    exact = x.double() @ reference.double().T + bias.double() + residual.double()
    got = packed.add(x, residual).double()
    assert ((got - exact).abs() <= one_rounding_bound(exact, 2 * in_features)).all()


def test_gguf_mode_computes_4_bit_rows_on_their_blocks(k_model_dir, tmp_path, native):
    """--quantization gguf: projections whose rows are all Q4_K go to the int4 kernel with
    the file's groups; a fused qkv of Q4_K and Q8_0 shards to it as two planes; one with a
    Q6_K shard is split: q and k on the int4 kernel, v's values in the dtype; the logits
    are about as close to the float32 reference as the bfloat16 model's."""
    if not GGUFFormat.supports(BF16, native):
        pytest.skip("this CPU has no bfloat16 native int4 kernel")
    path = str(tmp_path / "m.gguf")
    stored = write_gguf(k_model_dir, path, Q.Q4_K, overrides={
        "blk.0.attn_v.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q8_0})
    model, _ = load_model(path, BF16, CPU, "gguf", native)
    layer0, layer1 = model.model.layers
    assert isinstance(layer1.mlp.down_proj.packed, NativeInt4Weight)
    assert isinstance(layer1.self_attn.qkv_proj.packed, NativeInt4PlanesWeight)
    split = layer0.self_attn.qkv_proj.packed
    assert isinstance(split, StackedRowsWeight) and len(split.parts) == 2
    assert isinstance(split.parts[0], NativeInt4Weight)  # q and k
    assert not isinstance(split.parts[1], NativeInt4Weight | NativeInt4PlanesWeight)  # v
    # the packed planes are the file's: the kernel times the identity gives the weights
    for linear, names, inputs in [
        (layer0.self_attn.qkv_proj, ["self_attn.q_proj", "self_attn.k_proj",
                                     "self_attn.v_proj"], 256),
        (layer1.mlp.down_proj, ["mlp.down_proj"], 512),
        (layer1.self_attn.qkv_proj, ["self_attn.q_proj", "self_attn.k_proj",
                                     "self_attn.v_proj"], 256),
    ]:
        got = linear.packed(torch.eye(inputs, dtype=BF16)).float().t()
        layer = 0 if linear is layer0.self_attn.qkv_proj else 1
        weight = torch.cat([stored[f"model.layers.{layer}.{n}.weight"] for n in names])
        assert torch.equal(got, weight.to(BF16).float())
    ref = AutoModelForCausalLM.from_pretrained(k_model_dir, dtype=torch.float32).eval()
    ref.load_state_dict(stored, strict=False)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(model).step([(0, PROMPT)], all_tokens=True)
    dense, _ = load_model(path, BF16, CPU, "none", native)
    dense_got = PagedRunner(dense).step([(0, PROMPT)], all_tokens=True)
    error, dense_error = ((g - expected).abs().mean() for g in (got, dense_got))
    assert error <= dense_error * 2  # bfloat16 activations' rounding, not a wrong weight


def test_gguf_mode_needs_a_gguf_file(tiny_model_dir, native):
    with pytest.raises(InvalidParameterError, match="GGUF file") as info:
        load_model(tiny_model_dir("llama"), BF16, CPU, "gguf", native)
    assert info.value.param == "quantization"


def expect_load_error(path, *fragments: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        model, _ = load_model(str(path), torch.float32, CPU)
    message = str(info.value)
    assert "\n" not in message
    for fragment in (str(path), *fragments):
        assert fragment in message, message
    return message


def test_an_unsupported_type_names_file_tensor_type_and_the_supported_ones(tmp_path):
    """An IQ type (which tokenmill does not read) is refused before any weight is read."""
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 256 // block_size * type_size),
                                                      np.uint8), raw_dtype=Q.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expect_load_error(path, "blk.0.attn_q.weight", "unsupported GGUF type IQ4_NL",
                      "supported: F32, F16, BF16", "Q4_K", "Q6_K")


@pytest.mark.parametrize("keep", [0.999, 0.9, 0.5, 0.1])
def test_a_truncated_file_is_one_clear_error(k_model_dir, tmp_path, keep):
    """Cut anywhere (in the tensor data, the tensor table, the metadata), a K-quant file
    raises ModelLoadError naming it and saying it is truncated or damaged."""
    path = tmp_path / "m.gguf"
    write_gguf(k_model_dir, str(path), Q.Q4_K)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    expect_load_error(path, "corrupt GGUF file", "truncated or damaged")


def test_a_damaged_tensor_table_is_one_clear_error(k_model_dir, tmp_path):
    """A tensor whose recorded type is a number no GGUF type has."""
    path = tmp_path / "m.gguf"
    write_gguf(k_model_dir, str(path), Q.Q4_K)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # after the name, n_dims and two dims
    data[at:at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    expect_load_error(path, "corrupt GGUF file")
