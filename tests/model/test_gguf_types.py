"""GGUF tensor types: every supported type loads bit for bit as the gguf package's reference
dequantization computes it; ``--quantization gguf`` computes on the file's own blocks
exactly, a tied output head too: on a CPU with AVX512-VNNI Q4_0, Q4_1, Q4_K, Q6_K and Q8_0
on the integer kernels over int8 activations (``quantization_hosts.gguf_integer_here``),
and elsewhere (and the other types there) Q8_0 and Q5_0 as int8 with a scale per 32
inputs, Q6_K and Q3_K with one per 16, others but Q2_K as 4-bit planes, on the weight-only
kernels; a file with an unsupported type, or truncated, fails with one clear
ModelLoadError.

The files are written here, offline: tensors of the types the gguf package cannot
quantize (and, to cover every bit pattern, all the others too) are random valid blocks.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf_writer import random_blocks, write_gguf
from paged_runner import PagedRunner, greedy_generate
from transformers import AutoModelForCausalLM

from quantization_hosts import gguf_integer_here
from tokenmill.errors import InvalidParameterError, ModelLoadError
from tokenmill.kernels import NativeKernels
from tokenmill.models.gguf.blocks import (
    INT8_GROUP_TYPES,
    INT8_GROUPS,
    PLANE_TYPES,
    SUPPORTED_TYPES,
    FileRows,
)
from tokenmill.models.gguf.loader import open_gguf
from tokenmill.models.loader import load_model
from tokenmill.models.weights.formats import GGUFFormat, StackedRowsWeight
from tokenmill.models.weights.native_weights import (
    NativeInt4PlanesWeight,
    NativeInt4Weight,
    NativeInt8GroupWeight,
    NativeVnniQ4KWeight,
    NativeVnniQ6KWeight,
    NativeVnniQ8_0Weight,
    NativeVnniW4A8Weight,
    NativeWeight,
)
from tokenmill.models.weights.quantizations import choose_weight_format
from tokenmill.models.weights.torch_weights import OneDNNWeight

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_model import make_tiny_model_dir  # noqa: E402

CPU = torch.device("cpu")
BF16 = torch.bfloat16
F32 = torch.float32
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
    """A whole model of the type computes what Hugging Face's does with the same weights.

    Random K-quant blocks give logits up to ~70, where float32 summation order alone moves
    a logit by ~1e-3 (Hugging Face's own float32 logits differ from its float64 ones that
    much), so the absolute tolerance scales with the largest logit."""
    path = str(tmp_path / "m.gguf")
    stored = write_gguf(k_model_dir, path, qtype, random=True)
    ours, _ = load_model(path, torch.float32, CPU)
    ref = AutoModelForCausalLM.from_pretrained(k_model_dir, dtype=torch.float32).eval()
    ref.load_state_dict(stored, strict=False)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got, expected, atol=2e-5 * scale, rtol=1e-4)


def plane_values(planes, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum over the planes of q * scale + min, computed in ``dtype``."""
    total = torch.zeros(rows, cols, dtype=dtype)
    for q, scales, mins in planes:
        value = q.to(dtype).view(rows, -1, 32) * scales.to(dtype)[..., None]
        total += (value + mins.to(dtype)[..., None]).view(rows, cols)
    return total


def test_every_quantized_type_but_q2_k_and_mxfp4_takes_one_exact_route():
    """Q8_0 and Q5_0 (d q, per 32) and Q6_K and Q3_K (d sc q, per 16) go to int8 groups;
    the types with a minimum per 32 and 4- or 5-bit q to 4-bit planes; none to both; Q2_K
    (a minimum per 16) and MXFP4 (4-bit floats) to neither."""
    assert INT8_GROUPS == {Q.Q8_0: 32, Q.Q5_0: 32, Q.Q6_K: 16, Q.Q3_K: 16}
    assert set(INT8_GROUP_TYPES) == set(INT8_GROUPS)
    assert set(PLANE_TYPES) == {Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_1, Q.Q5_K}
    quantized = set(SUPPORTED_TYPES) - {Q.F32, Q.F16, Q.BF16}
    assert quantized - set(INT8_GROUP_TYPES) - set(PLANE_TYPES) == {Q.Q2_K, Q.MXFP4}


# each type's q: its whole range, the extremes included (random blocks hold every pattern)
INT8_RANGES = {Q.Q8_0: (-128, 127), Q.Q5_0: (-16, 15), Q.Q6_K: (-32, 31), Q.Q3_K: (-4, 3)}


@pytest.mark.parametrize("qtype", INT8_GROUP_TYPES, ids=lambda q: q.name)
def test_int8_groups_reproduce_the_reference_dequantization(qtype):
    """Q8_0 (d q) and Q5_0 (d (q - 16)) as int8 q and a float32 scale per 32 inputs, the
    block's float16 d widened; Q6_K (d sc (q - 32)) and Q3_K (d (sc - 32) q) with one per
    16, d times the sub-block's scale: q * scale is the reference, bit for bit in
    float32."""
    rows = FileRows(qtype, random_blocks(qtype, 24, 512, np.random.default_rng(1), 0.05), 512)
    group = rows.int8_group
    q, scales = rows.int8_groups()
    assert q.dtype == torch.int8 and q.shape == (24, 512)
    assert scales.dtype == torch.float32 and scales.shape == (24, 512 // group)
    if group == 32:
        assert torch.equal(scales.half().float(), scales)
    assert (int(q.min()), int(q.max())) == INT8_RANGES[qtype]
    reference = torch.from_numpy(dequantize(rows.data, qtype).reshape(24, 512))
    values = (q.float().view(24, -1, group) * scales[..., None]).view(24, 512)
    assert torch.equal(values, reference)


@pytest.mark.parametrize("qtype", PLANE_TYPES, ids=lambda q: q.name)
def test_4_bit_planes_reproduce_the_reference_dequantization(qtype):
    """Q4_0, Q4_1, Q4_K (one plane: Q4_K's 6-bit sub-scales and minimums expanded) and
    Q5_1, Q5_K (two) as a scale and a minimum per 32 inputs: the sum of q * scale + min is
    the reference, bit for bit in float32, or for Q5_1 and Q5_K the exact value that the
    reference rounds once to float32."""
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


def one_rounding_bound(exact: torch.Tensor, k: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    """One rounding of the exact result to ``dtype``, plus float32 summation error."""
    unit = 2.0**-8 if dtype == BF16 else 2.0**-24
    return exact.abs() * unit + k * 2.0**-22 * exact.abs().max()


def float32_sums_bound(exact: torch.Tensor, terms: torch.Tensor, k: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """One rounding of the exact result to ``dtype``, plus the error of summing k terms in
    float32 in any order, given ``terms``: the sum of their magnitudes."""
    unit = 2.0**-8 if dtype == BF16 else 2.0**-24
    return exact.abs() * unit + k * 2.0**-24 * terms


def supported_or_skip(dtype: torch.dtype, native) -> None:
    """Skips where the host has no native linear kernels for ``dtype`` (its capabilities,
    not the formats' choice: a format that wrongly refuses them fails)."""
    if not native.capabilities.linear(dtype):
        pytest.skip(f"this CPU has no native linear kernels for {dtype}")


def weight_only_gguf(dtype: torch.dtype, native: NativeKernels) -> GGUFFormat:
    """``--quantization gguf``'s format as a host without AVX512-VNNI builds it: every route
    on the weight-only kernels (activations as they are)."""
    fmt = choose_weight_format(dtype, CPU, "gguf", native)
    return GGUFFormat(native, fmt.dense, integer=False)


# the weight classes of the integer routes (a VNNI host), and of the weight-only ones
INTEGER_KINDS = {Q.Q4_0: NativeVnniW4A8Weight, Q.Q4_1: NativeVnniW4A8Weight,
                 Q.Q4_K: NativeVnniQ4KWeight, Q.Q6_K: NativeVnniQ6KWeight,
                 Q.Q8_0: NativeVnniQ8_0Weight}
WEIGHT_ONLY_KINDS = {Q.Q4_0: NativeInt4Weight, Q.Q4_1: NativeInt4Weight,
                     Q.Q4_K: NativeInt4Weight, Q.Q6_K: NativeInt8GroupWeight,
                     Q.Q8_0: NativeInt8GroupWeight}


def gguf_route(qtype, native: NativeKernels) -> tuple[type, int | None]:
    """The class ``--quantization gguf`` packs rows of ``qtype`` in on this host, and for
    int8 groups their size."""
    integer = gguf_integer_here(native.capabilities)
    kind = (INTEGER_KINDS if integer else WEIGHT_ONLY_KINDS)[qtype]
    return kind, INT8_GROUPS[qtype] if kind is NativeInt8GroupWeight else None


@pytest.mark.parametrize("qtype", INT8_GROUP_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_int8_group_kernel_on_file_blocks_matches_the_reference_matmul(native, qtype, dtype,
                                                                      batch):
    """``GGUFFormat``'s weight-only routes put Q8_0 and Q5_0 rows on the int8 kernel with a
    scale per 32 inputs, Q6_K and Q3_K rows with one per 16, which computes x @ W.T + b
    (+ residual) for W the reference dequantization within float32 summation (and, in
    bfloat16, one rounding); each row's bits do not depend on the batch. 200 outputs:
    panels of 32 and 16 with a partial last one, and (float32) runs of several panels for
    one or two rows; 17 rows: chunks, or (float32) a widened copy."""
    supported_or_skip(dtype, native)
    out_features, in_features = 200, 512
    rows = FileRows(qtype, random_blocks(qtype, out_features, in_features,
                                         np.random.default_rng(2), 0.05), in_features)
    reference = rows.dequantize()
    gen = torch.Generator().manual_seed(batch)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    packed = weight_only_gguf(dtype, native).pack_rows(reference.to(dtype), bias, [rows])
    assert type(packed) is NativeInt8GroupWeight and packed.group == rows.int8_group
    x = torch.randn(batch, in_features, generator=gen).to(dtype)
    residual = torch.randn(batch, out_features, generator=gen).to(dtype)
    products = x.double().abs() @ reference.double().abs().T
    for got, extra in [(packed(x), None), (packed.add(x, residual), residual)]:
        assert got.dtype == dtype and got.shape == (batch, out_features)
        exact = x.double() @ reference.double().T + bias.double()
        terms = products + bias.double().abs()
        if extra is not None:
            exact, terms = exact + extra.double(), terms + extra.double().abs()
        bound = float32_sums_bound(exact, terms, in_features + 2, dtype)
        assert ((got.double() - exact).abs() <= bound).all()
    alone = torch.cat([packed.add(x[r:r + 1], residual[r:r + 1]) for r in range(batch)])
    assert torch.equal(alone, packed.add(x, residual))


def routes(packed: StackedRowsWeight) -> list[tuple[type, int | None]]:
    """Each part's class, and for int8 groups their size."""
    return [(type(part), getattr(part, "group", None)) for part in packed.parts]


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_rows_of_mixed_types_are_packed_in_runs_of_one_route(native, dtype):
    """A projection read from several tensors of different types (a fused qkv or gate_up)
    is split where the route or the int8 group size changes (the weight-only routes): Q4_K
    and Q5_K (planes, Q4_K's second one zero), Q8_0 and Q5_0 (int8 groups of 32), Q6_K and
    Q3_K (of 16), Q2_K (dense, in the dtype), Q8_0 again (of 32); the parts side by side
    compute x @ W.T + b."""
    supported_or_skip(dtype, native)
    in_features, rng = 512, np.random.default_rng(4)
    shards = [FileRows(qtype, random_blocks(qtype, n, in_features, rng, 0.05), in_features)
              for qtype, n in [(Q.Q4_K, 24), (Q.Q5_K, 40), (Q.Q8_0, 16), (Q.Q5_0, 32),
                               (Q.Q6_K, 8), (Q.Q3_K, 16), (Q.Q2_K, 8), (Q.Q8_0, 24)]]
    reference = torch.cat([r.dequantize() for r in shards])
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(reference.shape[0], generator=gen).to(dtype)
    packed = weight_only_gguf(dtype, native).pack_rows(reference.to(dtype), bias, shards)
    assert isinstance(packed, StackedRowsWeight)
    dense = routes(packed)[3]
    assert dense[0] not in (NativeInt4Weight, NativeInt4PlanesWeight, NativeInt8GroupWeight)
    assert routes(packed) == [(NativeInt4PlanesWeight, None), (NativeInt8GroupWeight, 32),
                              (NativeInt8GroupWeight, 16), dense, (NativeInt8GroupWeight, 32)]
    x = torch.randn(5, in_features, generator=gen).to(dtype)
    weight = reference.double()
    weight[136:144] = reference[136:144].to(dtype).double()  # the dense rows, in the dtype
    exact = x.double() @ weight.T + bias.double()
    got = packed(x)
    assert got.dtype == dtype
    assert ((got.double() - exact).abs() <= one_rounding_bound(exact, 2 * in_features, dtype)).all()


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_q8_0_rows_then_q6_k_rows_are_two_int8_weights(native, dtype, batch):
    """Q8_0 rows (groups of 32) then Q6_K rows (of 16), as a fused qkv whose v is Q6_K
    beside a Q8_0 q and k: two int8 group weights, one per group size (one weight holds
    one size), which side by side compute x @ W.T + b for W the reference
    dequantization (the weight-only routes)."""
    supported_or_skip(dtype, native)
    in_features, rng = 512, np.random.default_rng(6)
    shards = [FileRows(qtype, random_blocks(qtype, n, in_features, rng, 0.05), in_features)
              for qtype, n in [(Q.Q8_0, 40), (Q.Q8_0, 24), (Q.Q6_K, 36)]]
    reference = torch.cat([r.dequantize() for r in shards])
    gen = torch.Generator().manual_seed(batch)
    bias = torch.randn(reference.shape[0], generator=gen).to(dtype)
    packed = weight_only_gguf(dtype, native).pack_rows(reference.to(dtype), bias, shards)
    assert isinstance(packed, StackedRowsWeight)
    assert routes(packed) == [(NativeInt8GroupWeight, 32), (NativeInt8GroupWeight, 16)]
    x = torch.randn(batch, in_features, generator=gen).to(dtype)
    exact = x.double() @ reference.double().T + bias.double()
    terms = x.double().abs() @ reference.double().abs().T + bias.double().abs()
    got = packed(x)
    assert got.dtype == dtype and got.shape == (batch, 100)
    bound = float32_sums_bound(exact, terms, in_features + 1, dtype)
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_integer_routes_split_where_the_type_changes(native, dtype):
    """On a VNNI host a projection of many types is split where the route changes, each
    run of Q4_K, Q4_0, Q8_0 or Q6_K rows on its own integer kernel and the other types on
    the weight-only ones; each part computes what its kind packed from its rows alone
    does, and the whole is the reference product within the rounding of x to 8 bits."""
    if not gguf_integer_here(native.capabilities):
        pytest.skip("the integer routes need a CPU with AVX512-VNNI")
    in_features, rng = 512, np.random.default_rng(8)
    types = [(Q.Q4_K, 24), (Q.Q4_0, 32), (Q.Q5_K, 40), (Q.Q8_0, 16), (Q.Q8_0, 8),
             (Q.Q5_0, 32), (Q.Q6_K, 8), (Q.Q3_K, 16), (Q.Q8_0, 24), (Q.Q4_1, 7)]
    shards = [FileRows(qtype, random_blocks(qtype, n, in_features, rng, 0.05), in_features)
              for qtype, n in types]
    reference = torch.cat([r.dequantize() for r in shards])
    packed = choose_weight_format(dtype, CPU, "gguf", native).pack_rows(
        reference.to(dtype), None, shards)
    assert routes(packed) == [
        (NativeVnniQ4KWeight, None), (NativeVnniW4A8Weight, None),
        (NativeInt4PlanesWeight, None), (NativeVnniQ8_0Weight, None),
        (NativeInt8GroupWeight, 32), (NativeVnniQ6KWeight, None),
        (NativeInt8GroupWeight, 16), (NativeVnniQ8_0Weight, None),
        (NativeVnniW4A8Weight, None)]
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(9)).to(dtype)
    got = packed(x)
    first = 0
    for part, count in zip(packed.parts, [24, 32, 40, 24, 32, 8, 16, 24, 7], strict=True):
        assert torch.equal(got[:, first:first + count], part(x))
        first += count
    own = NativeVnniQ8_0Weight(native, reference[64:88], None,
                               tuple(torch.cat(f) for f in zip(shards[3].own_fields(),
                                                               shards[4].own_fields(),
                                                               strict=True)))
    assert torch.equal(got[:, 96:120], own(x))
    exact = x.double() @ reference.double().T
    assert (got.double() - exact).norm() <= 0.01 * exact.norm()


@pytest.mark.parametrize("qtype", PLANE_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("batch", [1, 9])
def test_int4_kernel_on_file_planes_matches_the_reference_matmul(native, qtype, batch):
    """``GGUFFormat``'s weight-only routes put a file's planes on the int4 kernel, which
    computes x @ W.T + b for W the reference dequantization, within the kernel's own
    arithmetic (one bfloat16 rounding)."""
    supported_or_skip(BF16, native)
    out_features, in_features = 40, 512
    rng = np.random.default_rng(2)
    rows = FileRows(qtype, random_blocks(qtype, out_features, in_features, rng, 0.05),
                    in_features)
    reference = rows.dequantize()
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(out_features, generator=gen).to(BF16)
    packed = weight_only_gguf(BF16, native).pack_rows(reference.to(BF16), bias, [rows])
    kind = NativeInt4Weight if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else NativeInt4PlanesWeight
    assert type(packed) is kind
    x = torch.randn(batch, in_features, generator=gen).to(BF16)
    residual = torch.randn(batch, out_features, generator=gen).to(BF16)
    exact = x.double() @ reference.double().T + bias.double() + residual.double()
    got = packed.add(x, residual).double()
    assert ((got - exact).abs() <= one_rounding_bound(exact, 2 * in_features)).all()


def identity_gives(packed, weight: torch.Tensor) -> None:
    """``packed`` times the identity (bfloat16) is ``weight`` rounded to bfloat16: exactly,
    but for the 4-bit weights of the integer kernels, whose arithmetic centres them on 8
    (``vnni_linear.cpp``; float32 rounding) and which may land a bfloat16 unit off."""
    got = packed(torch.eye(weight.shape[1], dtype=BF16)).float().t()
    parts = packed.parts if isinstance(packed, StackedRowsWeight) else [packed]
    if any(isinstance(p, NativeVnniQ4KWeight | NativeVnniW4A8Weight) for p in parts):
        bound = weight.abs() * 2.0**-7 + weight.abs().max() * 2.0**-20
        assert ((got - weight).abs() <= bound).all()
    else:
        assert torch.equal(got, weight.to(BF16).float())


def test_gguf_mode_computes_quantized_rows_on_their_blocks(k_model_dir, tmp_path, native):
    """--quantization gguf: projections whose rows are all Q4_K go to the Q4_K route
    (``gguf_route``: the integer kernel on a VNNI host, else the int4 kernel) with the
    file's groups, one of Q5_0 (a down projection, with the residual added in the kernel)
    to the int8 kernel with the file's scales; a fused qkv of Q4_K and Q8_0 or Q6_K shards
    is split: q and k on Q4_K's route, v on Q8_0's or Q6_K's; a gate_up of Q3_K (int8
    groups of 16) and Q4_K too, and one of Q4_K and Q2_K: up's values in the dtype; the
    untied Q6_K output head on Q6_K's route; each projection times the identity gives the
    file's weights; the logits are about as close to the float32 reference as the bfloat16
    model's."""
    if not GGUFFormat.supports(BF16, native):
        pytest.skip("this CPU has no bfloat16 native linear kernels")
    path = str(tmp_path / "m.gguf")
    stored = write_gguf(k_model_dir, path, Q.Q4_K, overrides={
        "blk.0.attn_v.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q8_0,
        "blk.1.ffn_down.weight": Q.Q5_0, "blk.0.ffn_up.weight": Q.Q2_K,
        "blk.1.ffn_gate.weight": Q.Q3_K, "output.weight": Q.Q6_K})
    model, _ = load_model(path, BF16, CPU, "gguf", native)
    layer0, layer1 = model.model.layers
    q4_k, q6_k, q8_0 = (gguf_route(qtype, native) for qtype in (Q.Q4_K, Q.Q6_K, Q.Q8_0))
    assert type(layer0.mlp.down_proj.packed) is q4_k[0]
    assert type(layer1.mlp.down_proj.packed) is NativeInt8GroupWeight
    assert (type(model.lm_head.packed), getattr(model.lm_head.packed, "group", None)) == q6_k
    dense = NativeWeight | OneDNNWeight
    for split, kinds in [
        (layer0.self_attn.qkv_proj.packed, [q4_k, q6_k]),
        (layer1.self_attn.qkv_proj.packed, [q4_k, q8_0]),
        (layer0.mlp.gate_up_proj.packed, [q4_k, (dense, None)]),
        (layer1.mlp.gate_up_proj.packed, [(NativeInt8GroupWeight, 16), q4_k]),
    ]:
        assert isinstance(split, StackedRowsWeight) and len(split.parts) == len(kinds)
        for part, (kind, group) in zip(split.parts, kinds, strict=True):
            assert isinstance(part, kind) and getattr(part, "group", None) == group
    # the packed blocks are the file's: the kernel times the identity gives the weights
    # (``identity_gives``)
    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    gate_up = ["mlp.gate_proj", "mlp.up_proj"]
    for layer, linear, names in [
        (0, layer0.self_attn.qkv_proj, qkv),
        (0, layer0.mlp.gate_up_proj, gate_up),
        (0, layer0.mlp.down_proj, ["mlp.down_proj"]),
        (1, layer1.mlp.down_proj, ["mlp.down_proj"]),
        (1, layer1.self_attn.qkv_proj, qkv),
        (1, layer1.mlp.gate_up_proj, gate_up),
    ]:
        weight = torch.cat([stored[f"model.layers.{layer}.{n}.weight"] for n in names])
        identity_gives(linear.packed, weight)
    identity_gives(model.lm_head.packed, stored["lm_head.weight"])
    ref = AutoModelForCausalLM.from_pretrained(k_model_dir, dtype=torch.float32).eval()
    ref.load_state_dict(stored, strict=False)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(model).step([(0, PROMPT)], all_tokens=True)
    dense, _ = load_model(path, BF16, CPU, "none", native)
    dense_got = PagedRunner(dense).step([(0, PROMPT)], all_tokens=True)
    error, dense_error = ((g - expected).abs().mean() for g in (got, dense_got))
    assert error <= dense_error * 2  # bfloat16 activations' rounding, not a wrong weight


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q8_0, Q.Q4_K, Q.Q2_K], ids=lambda q: q.name)
def test_gguf_mode_computes_a_tied_head_on_the_embedding_blocks(tmp_path, native, qtype):
    """A tied output head (no ``output.weight``): its logits come from the embedding
    tensor's own blocks, routed as any projection's rows of the type (``gguf_route``; Q2_K
    dense), while the token lookup dequantizes the rows it reads: both hold the file's
    weights."""
    if not GGUFFormat.supports(BF16, native):
        pytest.skip("this CPU has no bfloat16 native linear kernels")
    kind = NativeWeight | OneDNNWeight if qtype == Q.Q2_K else gguf_route(qtype, native)[0]
    hf_dir = make_tiny_model_dir(tmp_path / "hf", "llama", hidden_size=256,
                                 intermediate_size=512, tie_word_embeddings=True)
    path = str(tmp_path / "m.gguf")
    stored = write_gguf(hf_dir, path, Q.Q4_K, overrides={"token_embd.weight": qtype})
    model, _ = load_model(path, BF16, CPU, "gguf", native)
    assert model.lm_head is None and isinstance(model.packed_tied_head, kind)
    embedding = stored["model.embed_tokens.weight"].to(BF16)
    lookup = model.model.embed_tokens(torch.arange(embedding.shape[0]))
    assert torch.equal(lookup, embedding)
    identity_gives(model.packed_tied_head, stored["model.embed_tokens.weight"])
    hidden = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).to(BF16)
    assert torch.equal(model.compute_logits(hidden), model.packed_tied_head(hidden).float())


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_gguf_mode_needs_a_gguf_file(tiny_model_dir, native, dtype):
    supported_or_skip(dtype, native)
    with pytest.raises(InvalidParameterError, match="GGUF file") as info:
        load_model(tiny_model_dir("llama"), dtype, CPU, "gguf", native)
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


# a Q4_K_M file's mix: Q4_K, with Q6_K for v, a down projection and the untied head
Q4_K_M = {"blk.0.attn_v.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q6_K,
          "blk.1.ffn_down.weight": Q.Q6_K, "output.weight": Q.Q6_K}


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_integer_routes_stay_within_the_rounding_of_activations(k_model_dir, tmp_path, native,
                                                                qtype):
    """A Q8_0, a Q4_K_M-like (``Q4_K_M``) and a Q6_K file under ``--quantization gguf`` on a
    VNNI host, every projection and the head on the integer kernels: in bfloat16 and in
    float32 their logits are as far from the weight-only kernels' float32 ones (a host
    without VNNI) as 2.5 times the bfloat16 weight-only model's (measured: 1.1 to 1.9
    times), and the Q8_0 file (quantized from the model's weights) generates the same
    greedy tokens. (Random K-quant blocks make a model whose bfloat16 and float32 runs
    already part ways after a few tokens.)"""
    if not gguf_integer_here(native.capabilities):
        pytest.skip("the integer routes need a CPU with AVX512-VNNI")
    path = str(tmp_path / "m.gguf")
    write_gguf(k_model_dir, path, qtype, overrides=Q4_K_M if qtype == Q.Q4_K else None)
    weight_only_kernels = dataclasses.replace(native, capabilities=dataclasses.replace(
        native.capabilities, vnni_linear=False))
    reference, bf16 = (load_model(path, dtype, CPU, "gguf", weight_only_kernels)[0]
                       for dtype in (F32, BF16))
    expected = PagedRunner(reference).step([(0, PROMPT)], all_tokens=True)
    bf16_error = (PagedRunner(bf16).step([(0, PROMPT)], all_tokens=True) - expected).norm()
    for dtype in (BF16, F32):
        integer, _ = load_model(path, dtype, CPU, "gguf", native)
        kinds = {type(part) for layer in integer.model.layers
                 for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                layer.mlp.gate_up_proj, layer.mlp.down_proj, integer.lm_head)
                 for part in getattr(linear.packed, "parts", [linear.packed])}
        assert kinds == {INTEGER_KINDS[t] for t in ({qtype, Q.Q6_K} if qtype == Q.Q4_K
                                                     else {qtype})}
        got = PagedRunner(integer).step([(0, PROMPT)], all_tokens=True)
        assert (got - expected).norm() <= 2.5 * bf16_error
        if qtype == Q.Q8_0:
            assert greedy_generate(integer, PROMPT, 8) == greedy_generate(reference, PROMPT, 8)


def test_q4_0_rows_whose_minimum_float16_cannot_hold_take_the_int4_kernel(native):
    """Q4_0's minimum -8 d overflows float16 for d above 8188: such rows keep the int4
    kernel's float32 scales and minimums (exact), the others take w4a8's float16 ones."""
    if not gguf_integer_here(native.capabilities):
        pytest.skip("the integer routes need a CPU with AVX512-VNNI")
    rng = np.random.default_rng(10)
    fmt = choose_weight_format(F32, CPU, "gguf", native)
    for d, kind in [(0.05, NativeVnniW4A8Weight), (1e4, NativeInt4Weight)]:
        data = random_blocks(Q.Q4_0, 32, 256, rng, 0.05)
        blocks = data.reshape(-1, 18)
        blocks[:, :2] = np.full((blocks.shape[0], 1), d, np.float16).view(np.uint8)
        rows = FileRows(Q.Q4_0, data, 256)
        packed = fmt.pack_rows(torch.empty(32, 256), None, [rows])
        assert type(packed) is kind
        got = packed(torch.eye(256)).t()
        bound = rows.dequantize().abs() * 2.0**-20 + 2.0**-20 * rows.dequantize().abs().max()
        assert ((got - rows.dequantize()).abs() <= bound).all()
