"""Mixture-of-experts families (Qwen3-MoE; Qwen2-MoE with its shared expert and a dense
layer; Mixtral and gpt-oss, from their folders only): tiny random checkpoints agree with
transformers in float32 from their folders and as GGUF files (ours, and llama.cpp's
converter's where its source tree is here); router ties break as transformers breaks
them; experts run grouped, each active one once per layer, inactive ones not at all; with
``--quantization gguf`` experts keep the file's blocks, and MXFP4 experts load bit for
bit; checkpoints whose experts disagree with their config are refused."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_writer import write_gguf
from paged_runner import PagedRunner, greedy_generate
from safetensors.torch import load_file, save_file
from test_model_families import (
    LLAMA_CPP,
    PROMPT,
    hf_greedy,
    hf_logits,
    hf_model,
    llama_cpp_convert,
)

from quantization_hosts import gguf_integer_here
from tokenmill.errors import ModelLoadError
from tokenmill.models.gguf.loader import open_gguf
from tokenmill.models.layers.experts import SparseMoeBlock
from tokenmill.models.loader import load_model
from tokenmill.models.registry import resolve_model_class
from tokenmill.models.weights.formats import GGUFFormat
from tokenmill.models.weights.native_weights import (
    NativeInt4Weight,
    NativeInt8GroupWeight,
    NativeVnniQ8_0Weight,
    NativeVnniW4A8Weight,
)

CPU = torch.device("cpu")
NEW_TOKENS = 30
# variant -> the GGUF architecture its file takes
MOE = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}


def experts_of(model) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


@pytest.mark.parametrize("variant", [*MOE, "mixtral", "gpt_oss"])
def test_greedy_and_logits_match_hf(tiny_model_dir, variant):
    """Greedy tokens (prefill in chunks of 6) and the prompt's logits against transformers;
    Qwen2-MoE's second layer is dense (``mlp_only_layers``); Mixtral's window (12) cuts
    the 20-token prompt; gpt-oss's sliding layers (window 8) alternate with full ones,
    under YaRN, each head with its sink, experts with biases and the clamped gate."""
    model_dir = tiny_model_dir(variant)
    ours, config = load_model(model_dir, torch.float32, CPU)
    assert len(experts_of(ours)) == config.num_hidden_layers - len(config.dense_mlp_layers)
    theirs = hf_model(model_dir)
    assert greedy_generate(ours, PROMPT, NEW_TOKENS, chunk_size=6) == hf_greedy(
        theirs, PROMPT, NEW_TOKENS)
    got = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    torch.testing.assert_close(got, hf_logits(theirs, PROMPT), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", MOE)
def test_gguf_matches_hf(tiny_model_dir, tmp_path, variant):
    """The same checkpoint as a GGUF file (3-D expert tensors): the same config, the same
    logits."""
    model_dir = tiny_model_dir(variant)
    path = str(tmp_path / "m.gguf")
    write_gguf(model_dir, path, arch=MOE[variant])
    ours, config = load_model(path, torch.float32, CPU)
    hf_config = load_model(model_dir, torch.float32, CPU)[1]
    assert config.num_experts == hf_config.num_experts
    assert config.norm_topk_prob == hf_config.norm_topk_prob
    assert config.dense_mlp_layers == hf_config.dense_mlp_layers
    got = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    torch.testing.assert_close(got, hf_logits(hf_model(model_dir), PROMPT), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason=f"no llama.cpp source tree (convert_hf_to_gguf.py) at {LLAMA_CPP}; "
                           "set PEERS to the folder holding llama.cpp/")
def test_llama_cpp_converted_gguf_matches_hf(tiny_model_dir, tmp_path):
    """llama.cpp's converter's file of the Qwen3-MoE checkpoint: the same greedy tokens."""
    model_dir = tiny_model_dir("qwen3_moe")
    ours, _ = load_model(llama_cpp_convert(model_dir, str(tmp_path / "m.gguf")), torch.float32,
                         CPU)
    prompt = [t for t in PROMPT if t < 400]  # within the tokenizer's vocabulary
    assert greedy_generate(ours, prompt, NEW_TOKENS, chunk_size=6) == hf_greedy(
        hf_model(model_dir), prompt, NEW_TOKENS)


def test_gpt_oss_sinks_matter(tiny_model_dir):
    """The tiny gpt-oss's sinks are not 0, and without them the logits differ."""
    model_dir = tiny_model_dir("gpt_oss")
    ours, _ = load_model(model_dir, torch.float32, CPU)
    sinks = [layer.self_attn.sinks for layer in ours.model.layers]
    assert min(float(s.abs().max()) for s in sinks) > 0.01
    with_sinks = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    for s in sinks:
        s.data.fill_(float("-inf"))  # a sink of weight 0: plain softmax attention
    without = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    assert (with_sinks - without).abs().max() > 1e-3


def test_router_ties_break_as_transformers(tiny_model_dir, tmp_path):
    """The first layer's router gives every expert the same row, so each token's top 2 are
    a tie of all 8 (their probabilities equal bit for bit); the second's ties experts 2..5:
    the tokens and logits still match transformers', so the tied experts chosen are the
    same ones."""
    source = tiny_model_dir("qwen3_moe")
    model_dir = str(tmp_path / "tied")
    shutil.copytree(source, model_dir)
    weights = load_file(f"{source}/model.safetensors")
    for name, tensor in weights.items():
        if name.endswith("0.mlp.gate.weight"):
            tensor[:] = tensor[0]
        elif name.endswith("mlp.gate.weight"):
            tensor[2:6] = tensor[2]
    save_file(weights, f"{model_dir}/model.safetensors", metadata={"format": "pt"})
    ours, _ = load_model(model_dir, torch.float32, CPU)
    theirs = hf_model(model_dir)
    block = experts_of(ours)[0]
    routes = []
    route = block.route
    block.route = lambda x: (routes.append((block.gate(x), route(x)[1])), route(x))[1]
    PagedRunner(ours).step([(0, PROMPT)])
    del block.route
    (logits, _), = routes
    assert (logits == logits[:, :1]).all()  # tied bit for bit
    assert greedy_generate(ours, PROMPT, NEW_TOKENS) == hf_greedy(theirs, PROMPT, NEW_TOKENS)
    got = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    torch.testing.assert_close(got, hf_logits(theirs, PROMPT), atol=1e-5, rtol=1e-5)


def test_experts_run_grouped(tiny_model_dir, monkeypatch):
    """In one forward pass over a batch, each expert some token chose projects once, over
    exactly the rows routed to it; the others not at all."""
    ours, _ = load_model(tiny_model_dir("qwen3_moe"), torch.float32, CPU)
    block = experts_of(ours)[0]
    calls: list[tuple[int, int]] = []
    for index, expert in enumerate(block.experts):
        project = expert.project
        monkeypatch.setattr(expert, "project", lambda x, i=index, f=project: (
            calls.append((i, x.shape[0])), f(x))[1])
    x = torch.randn(9, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    _, chosen = block.route(x)
    expected = sorted(torch.bincount(chosen.flatten(), minlength=8).nonzero().flatten().tolist())
    block.project(x)
    assert [i for i, _ in calls] == expected
    assert [n for _, n in calls] == [int((chosen == i).sum()) for i in expected]


@pytest.mark.parametrize("qtype,weight_only,integer", [
    (GGMLQuantizationType.Q8_0, NativeInt8GroupWeight, NativeVnniQ8_0Weight),
    (GGMLQuantizationType.Q4_0, NativeInt4Weight, NativeVnniW4A8Weight)])
def test_experts_keep_the_files_blocks(tiny_model_dir, tmp_path, native, qtype, weight_only,
                                       integer):
    """``--quantization gguf``: every expert's projections compute on the file's own
    blocks (the native int8 or int4 kernel; on a VNNI host the integer ones,
    ``quantization_hosts.gguf_integer_here``), and each expert's outputs match those of
    the file's values in the dtype the format takes here (float32 first; in bfloat16, or
    with the activations rounded to int8, a rounding of the activations apart, so the
    whole model's routing may differ)."""
    dtype = next((d for d in (torch.float32, torch.bfloat16) if GGUFFormat.supports(d, native)),
                 None)
    if dtype is None:
        pytest.skip("this CPU has no native linear kernels")
    path = str(tmp_path / "m.gguf")
    write_gguf(tiny_model_dir("qwen3_moe"), path, qtype=qtype, arch="qwen3moe")
    ours, _ = load_model(path, dtype, CPU, quantization="gguf", kernels=native)
    dense, _ = load_model(path, dtype, CPU)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    integer_here = gguf_integer_here(native.capabilities)
    packed = integer if integer_here else weight_only
    tolerance = 1e-5 if dtype == torch.float32 and not integer_here else 2e-2
    for block, reference in zip(experts_of(ours), experts_of(dense), strict=True):
        for expert, same in zip(block.experts, reference.experts, strict=True):
            assert type(expert.down_proj.packed) is packed
            got, ref = expert.project(x).float(), same.project(x).float()
            torch.testing.assert_close(got, ref, atol=tolerance * ref.abs().max(), rtol=0)


def test_mxfp4_experts_load_bit_for_bit(tiny_model_dir, tmp_path):
    """Experts stored in MXFP4 (gpt-oss's type) load as ``gguf.quants``' dequantization of
    the file, bit for bit, and the model computes as transformers' on those values."""
    model_dir = tiny_model_dir("qwen3_moe")
    path = str(tmp_path / "m.gguf")
    mxfp4 = {f"blk.{i}.ffn_{p}_exps.weight": GGMLQuantizationType.MXFP4
             for i in range(2) for p in ("gate", "up", "down")}
    stored = write_gguf(model_dir, path, arch="qwen3moe", overrides=mxfp4)
    config, weights = open_gguf(path)
    unpacked = resolve_model_class(config.architecture)(config, torch.float32, CPU)
    unpacked.load_weights(weights)
    params = dict(unpacked.named_parameters())
    theirs = hf_model(model_dir)
    state = theirs.state_dict()
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = torch.stack([torch.cat([stored[f"{prefix}{e}.gate_proj.weight"],
                                          stored[f"{prefix}{e}.up_proj.weight"]])
                               for e in range(8)])
        down = torch.stack([stored[f"{prefix}{e}.down_proj.weight"] for e in range(8)])
        for ours_name, values in (("gate_up_proj", gate_up), ("down_proj", down)):
            loaded = torch.stack([params[f"{prefix}{e}.{ours_name}.weight"] for e in range(8)])
            assert torch.equal(loaded, values)
            state[prefix + ours_name] = values
    theirs.load_state_dict(state)
    ours, _ = load_model(path, torch.float32, CPU)
    got = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    torch.testing.assert_close(got, hf_logits(theirs, PROMPT), atol=1e-5, rtol=1e-5)


def test_experts_that_disagree_with_the_config_are_refused(tiny_model_dir, tmp_path):
    """Fewer experts, narrower ones, or a router of another count, in a folder or a GGUF
    file: a ModelLoadError (a ValueError) naming what disagrees."""
    source = tiny_model_dir("qwen3_moe")
    with open(f"{source}/config.json") as f:
        config = json.load(f)
    cases = [({"num_experts": 6}, "expert 6 of layer 0, but the config has num_experts = 6"),
             ({"num_experts": 10}, r"mlp.gate.weight.*num_experts = 10"),
             ({"moe_intermediate_size": 16}, r"expert width 16")]
    for i, (change, message) in enumerate(cases):
        model_dir = str(tmp_path / f"bad{i}")
        shutil.copytree(source, model_dir)
        with open(f"{model_dir}/config.json", "w") as f:
            json.dump({**config, **change}, f)
        with pytest.raises(ValueError, match=message):
            load_model(model_dir, torch.float32, CPU)
    bad = str(tmp_path / "bad.gguf")
    write_gguf(str(tmp_path / "bad0"), bad, arch="qwen3moe")  # says 6, holds 8
    with pytest.raises(ModelLoadError, match=r"num_experts = 6|not 6 experts"):
        load_model(bad, torch.float32, CPU)


def test_unsupported_architecture_names_the_supported_list(tmp_path):
    model_dir = tmp_path / "m"
    os.makedirs(model_dir)
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}))
    with pytest.raises(ModelLoadError, match="Qwen2MoeForCausalLM.*Qwen3MoeForCausalLM"):
        load_model(str(model_dir), torch.float32, CPU)
