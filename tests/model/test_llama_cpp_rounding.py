"""``--quantization gguf-llama-cpp``: activations rounded as llama.cpp's CPU backend rounds
them before a product with a weight of each GGUF type (Q8_0 blocks of 32, Q8_K blocks of
256, float16), the weights the file's exact values; a whole model computes what Hugging
Face's does on the same weights with every projection's input rounded that way."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_writer import gguf_name, random_blocks, write_gguf
from paged_runner import PagedRunner
from transformers import AutoModelForCausalLM

from tokenmill.errors import InvalidParameterError
from tokenmill.models.gguf.blocks import FileRows
from tokenmill.models.gguf.llama_cpp_rounding import (
    ROUNDINGS,
    VEC_DOT_TYPES,
    round_q8_0,
    round_q8_k,
)
from tokenmill.models.loader import load_model
from tokenmill.models.weights.formats import StackedRowsWeight
from tokenmill.models.weights.quantizations import choose_weight_format, resolve_dtype

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_model import make_tiny_model_dir  # noqa: E402

CPU = torch.device("cpu")
PROMPT = [4, 150, 23, 77, 310, 12, 9, 260, 45, 101, 33, 7, 88, 199, 5, 64, 2, 71]


def activations(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows of normal values at scales that differ from block to block, one block zero."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 2, cols // 32)[torch.randperm(cols // 32, generator=gen)]
    x = torch.randn(rows, cols, generator=gen) * scales.repeat_interleave(32)
    x[0, :32] = 0
    return x


def test_q8_0_rounding_is_the_q8_0_format_of_the_gguf_package():
    """llama.cpp's x86 conversion (multiply by ``127 / max``, round half to even) gives the
    reference's blocks (``d = max / 127``, multiply by ``1 / d``, round half away) on all
    but exact ties, which random values do not hit: the same float16 scales and integers."""
    x = activations(7, 1024)
    reference = dequantize(quantize(x.numpy(), Q.Q8_0), Q.Q8_0).reshape(x.shape)
    assert torch.equal(round_q8_0(x), torch.from_numpy(np.ascontiguousarray(reference)))


def test_q8_0_rounds_ties_to_even():
    block = torch.zeros(32)
    block[0], block[1], block[2] = 127.0, 0.5, 1.5  # d = 1: 0.5 and 1.5 are ties
    rounded = round_q8_0(block)
    assert rounded[:3].tolist() == [127.0, 0.0, 2.0]


def test_q8_k_rounding_follows_llama_cpp_reference_conversion():
    """Per 256 values: the first of largest magnitude ``m`` gives ``iscale = -127 / m`` (so
    ``m`` itself becomes -127 steps), ``q = min(round(iscale x), 127)`` with ties to even,
    and the value is ``q / iscale``."""
    block = torch.zeros(256)
    block[3], block[7], block[9], block[10] = -2.0, 2.0, 1.0, -0.5  # -2.0 comes first
    iscale = torch.tensor(-127.0) / -2.0  # 63.5: 1.0 -> 63.5 -> 64, -0.5 -> -31.75 -> -32
    rounded = round_q8_k(block)
    assert rounded[[3, 7, 9, 10]].tolist() == [
        (torch.tensor(v) / iscale).item() for v in (-127.0, 127.0, 64.0, -32.0)]
    assert not rounded[[0, 1, 2]].any()
    assert not round_q8_k(torch.zeros(256)).any()

    x = activations(5, 768)
    steps = round_q8_k(x).reshape(5, 3, 256)
    blocks = x.reshape(5, 3, 256)
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    q = steps * (-127 / extreme)
    assert torch.allclose(q, q.round(), atol=1e-4)  # whole steps of the block's scale
    assert q.round().abs().max() <= 127
    assert ((steps - blocks).abs() <= extreme.abs() / 127 * 0.5 * (1 + 1e-5)).all()


def q4_1_times_q8_1(rows: FileRows, x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q4_1 x Q8_1 product, summed in float64: per block of 32, ``d_w d_x (q_w .
    q_x) + m_w s_x``, with ``x``'s ``q_x``, float16 ``d_x`` and float16 ``s_x = d * sum
    q_x`` computed as its x86 conversion does, in float32."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q_x = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0)).reshape(x.shape[0], -1)
    d = amax.squeeze(-1) / 127
    d_x = d.half().double()
    s_x = (d * q_x.reshape(x.shape[0], -1, 32).sum(-1)).half().double()
    q_x = q_x.double()
    (q_w, d_w, m_w), = rows.int4_planes()
    products = (q_x.reshape(x.shape[0], 1, -1, 32)
                * q_w.double().reshape(1, q_w.shape[0], -1, 32)).sum(-1)  # [M, N, blocks]
    return (d_w.double()[None] * d_x[:, None] * products
            + m_w.double()[None] * s_x[:, None]).sum(-1)


def test_rows_of_mixed_types_round_the_input_for_each_run():
    """A fused weight of Q8_0, Q6_K, F16, then Q4_1 rows: four runs side by side, each the
    product of its rows' exact values with the input rounded for their type; Q4_1's as
    llama.cpp computes it with Q8_1 activations (their float16 sums times the minimums)."""
    in_features, rng = 512, np.random.default_rng(4)
    shards = [FileRows(qtype, random_blocks(qtype, n, in_features, rng, 0.05), in_features)
              for qtype, n in [(Q.Q8_0, 24), (Q.Q8_0, 8), (Q.Q6_K, 16), (Q.F16, 8),
                               (Q.Q4_1, 8)]]
    weights = [r.dequantize() for r in shards]
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(64, generator=gen)
    packed = choose_weight_format(torch.float32, CPU, "gguf-llama-cpp").pack_rows(
        torch.cat(weights), bias, shards)
    assert isinstance(packed, StackedRowsWeight) and len(packed.parts) == 4
    x = activations(3, in_features)
    runs = [(round_q8_0, torch.cat(weights[:2]), bias[:32]),
            (round_q8_k, weights[2], bias[32:48]),
            (lambda v: v.half().float(), weights[3], bias[48:56])]
    expected = torch.cat([rounding(x).double() @ w.double().T + b.double()
                          for rounding, w, b in runs]
                         + [q4_1_times_q8_1(shards[4], x) + bias[56:].double()], dim=-1)
    torch.testing.assert_close(packed(x).double(), expected, atol=1e-4, rtol=1e-5)
    residual = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(packed.add(x, residual).double(), expected + residual.double(),
                               atol=1e-4, rtol=1e-5)


def rounded_inputs_reference(model_dir: str, stored: dict[str, torch.Tensor], qtype: Q,
                             overrides: dict[str, Q]):
    """Hugging Face's model with the stored weights, every projection's input rounded for
    the GGUF type of its weight in the file (Q4_1's and Q5_1's sums of blocks, which
    ``test_rows_of_mixed_types_round_the_input_for_each_run`` checks, not modelled)."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref.load_state_dict(stored, strict=False)
    for name, module in ref.named_modules():
        if isinstance(module, torch.nn.Linear):
            kind = overrides.get(gguf_name(f"{name}.weight", "llama"), qtype)
            module.register_forward_pre_hook(
                lambda _, args, rounding=ROUNDINGS[VEC_DOT_TYPES[kind]]: (rounding(args[0]),))
    return ref


@pytest.mark.parametrize("qtype,overrides", [
    (Q.Q8_0, {}), (Q.Q6_K, {}), (Q.F16, {}),
    (Q.Q4_K, {"blk.0.attn_v.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q5_0,
              "output.weight": Q.Q6_K}),
], ids=["Q8_0", "Q6_K", "F16", "Q4_K-mix"])
def test_model_computes_hf_with_each_input_rounded_for_its_weight(tmp_path, qtype, overrides):
    model_dir = make_tiny_model_dir(tmp_path / "hf", "llama", hidden_size=256,
                                    intermediate_size=512, tie_word_embeddings=False)
    path = str(tmp_path / "m.gguf")
    stored = write_gguf(model_dir, path, qtype, overrides=overrides, random=True)
    ours, _ = load_model(path, torch.float32, CPU, "gguf-llama-cpp")
    if overrides:  # q, k and v rows of two types: two runs, each with its own rounding
        qkv = ours.model.layers[0].self_attn.qkv_proj.packed
        assert isinstance(qkv, StackedRowsWeight) and len(qkv.parts) == 2
    got = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    with torch.no_grad():
        rounded = rounded_inputs_reference(model_dir, stored, qtype, overrides)(
            torch.tensor([PROMPT])).logits[0]
        exact = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        exact.load_state_dict(stored, strict=False)
        unrounded = exact(torch.tensor([PROMPT])).logits[0]
    # Rounding amplifies float32 noise: an input a hair from a step's midpoint lands on
    # either side, moving its product by a whole step (1/127 of its block's largest value
    # for Q8 blocks), so the two runs differ where such inputs fall. Without the rounding
    # the difference is at least 10x larger.
    off = (got - rounded).abs().mean()
    assert off < (got - unrounded).abs().mean() / 10, off
    assert off < 2e-3 * max(1.0, rounded.abs().max().item())


def test_needs_float32_and_a_gguf_file(tiny_model_dir):
    assert resolve_dtype("auto", CPU, "gguf-llama-cpp") == torch.float32
    with pytest.raises(InvalidParameterError, match="float32") as info:
        load_model(tiny_model_dir("llama"), torch.bfloat16, CPU, "gguf-llama-cpp")
    assert info.value.param == "quantization"
    with pytest.raises(InvalidParameterError, match="GGUF file") as info:
        load_model(tiny_model_dir("llama"), torch.float32, CPU, "gguf-llama-cpp")
    assert info.value.param == "quantization"
