"""Loading: GGUF files in every supported type agree with Hugging Face; every way a load
can fail raises one clear ModelLoadError."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import write_gguf
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tokenmill.errors import ModelLoadError
from tokenmill.model_source import default_model_path, model_name_for
from tokenmill.models.config import ModelConfig
from tokenmill.models.loader import load_model
from tokenmill.models.registry import HF_FAMILIES, resolve_model_class

CPU = torch.device("cpu")
PROMPT = [4, 150, 23, 77, 310, 12, 9, 260, 45, 101, 33, 7, 88, 199, 5, 64, 2, 71]


def assert_matches_reference(model_path: str, hf_dir: str, state_dict=None):
    ours, _ = load_model(model_path, torch.float32, CPU)
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if state_dict is not None:
        ref.load_state_dict(state_dict, strict=False)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1],
    ids=lambda q: q.name
)
def test_gguf_llama_matches_hf_with_the_stored_weights(tiny_model_dir, tmp_path, qtype):
    """Q/K come back un-permuted and every quant type dequantizes to what was stored."""
    hf_dir = tiny_model_dir("llama_untied")
    path = str(tmp_path / "m.gguf")
    stored = write_gguf(hf_dir, path, qtype)
    assert_matches_reference(path, hf_dir, stored)


@pytest.mark.parametrize("variant,arch", [("qwen2", "qwen2"), ("llama3_rope", "llama")])
def test_gguf_other_layouts_match_hf(tiny_model_dir, tmp_path, variant, arch):
    """Qwen2 (biases, no Q/K permutation, tied) and llama3 rope given as a rope_freqs tensor."""
    hf_dir = tiny_model_dir(variant)
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_dir, path, arch=arch)
    config = load_model(path, torch.float32, CPU)[1]
    assert config.tie_word_embeddings
    assert config.attention_bias == (arch == "qwen2")
    assert (config.rope_scaling or {}).get("rope_type") == (
        "freq_factors" if variant == "llama3_rope" else None
    )
    assert_matches_reference(path, hf_dir)


def test_hf_folder_with_sharded_safetensors(tiny_model_dir, tmp_path):
    hf_dir = tiny_model_dir("llama_untied")
    sharded = tmp_path / "sharded"
    shutil.copytree(hf_dir, sharded)
    weights = load_file(str(sharded / "model.safetensors"))
    os.remove(sharded / "model.safetensors")
    names = sorted(weights)
    weight_map = {}
    for i, shard in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        shard_name = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: weights[n] for n in shard}, str(sharded / shard_name))
        weight_map.update(dict.fromkeys(shard, shard_name))
    assert_matches_reference(str(sharded), hf_dir)

    # with an index, only the shards it lists are read (a stray file is ignored)
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"unrelated.weight": torch.zeros(2)}, str(sharded / "consolidated.safetensors"))
    assert_matches_reference(str(sharded), hf_dir)
    os.remove(sharded / "model-00002-of-00002.safetensors")
    expect_load_error(sharded, "model-00002-of-00002.safetensors", "not found")


def expect_load_error(path, *fragments):
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path), torch.float32, CPU)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return message


def test_missing_path(tmp_path):
    expect_load_error(tmp_path / "nope", "model path not found", "nope")


def test_garbage_file(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a model at all" * 10)
    expect_load_error(path, "not a GGUF file")


def test_truncated_gguf(tiny_model_dir, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(tiny_model_dir("llama"), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    expect_load_error(path, "corrupt GGUF file")


def test_unknown_architecture_in_config(tiny_model_dir, tmp_path):
    folder = tmp_path / "other"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    expect_load_error(folder, "MambaForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM")


def test_unknown_architecture_in_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expect_load_error(path, "unsupported GGUF architecture", "mamba", "llama")


def test_folder_without_config_or_weights(tiny_model_dir, tmp_path):
    expect_load_error(tmp_path, "no config.json")
    folder = tmp_path / "noweights"
    shutil.copytree(tiny_model_dir("llama"), folder)
    os.remove(folder / "model.safetensors")
    expect_load_error(folder, "no *.safetensors")


def test_missing_and_misshapen_weights(tiny_model_dir, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("llama"), folder)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    expect_load_error(folder, "missing weights", "model.layers.1.self_attn.k_proj.weight")
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(weights, str(folder / "model.safetensors"))
    expect_load_error(folder, "k_proj", "(3, 64)", "(32, 64)")


def test_registry_names_supported_architectures():
    with pytest.raises(ValueError, match="Gemma3ForCausalLM, GptOssForCausalLM, "
                       "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, "
                       "Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, "
                       "Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        resolve_model_class("GPT2LMHeadModel")
    assert resolve_model_class("Qwen2ForCausalLM") is resolve_model_class("LlamaForCausalLM")


def test_config_from_older_hf_layout():
    """transformers 4.x: rope_theta + rope_scaling ("type" key); head_dim derived."""
    config = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0},
    }, HF_FAMILIES)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (config.head_dim, config.num_key_value_heads) == (16, 4)
    with pytest.raises(ModelLoadError, match="unsupported rope scaling type 'longrope'"):
        ModelConfig.from_hf_dict({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "rope_scaling": {"rope_type": "longrope", "factor": 4.0},
        }, HF_FAMILIES)


def test_model_names_and_default_path(tiny_model_dir):
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith(".gguf")
    assert model_name_for(None) == model_name_for(path) == "SmolLM2-135M-Instruct"
    folder = tiny_model_dir("llama")
    assert model_name_for(folder + os.sep) == os.path.basename(folder)
    assert model_name_for("/models/TinyLlama-1.1B.Q8_0.gguf") == "TinyLlama-1.1B.Q8_0"
