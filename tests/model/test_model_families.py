"""Qwen3, Mistral, Phi-3 and Gemma 3 (text): tiny random checkpoints, loaded from
safetensors and from GGUF, agree with Hugging Face in float32 (greedy tokens and logits);
``test_paged_batches`` runs them in ragged batches. A sliding window really cuts what each
layer attends to, and its blocks outside the window are never read."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf_writer import write_gguf
from paged_runner import PagedRunner, greedy_generate
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tokenmill.errors import ModelLoadError
from tokenmill.models.attention.metadata import AttentionMetadata
from tokenmill.models.attention.native import NativeAttention
from tokenmill.models.attention.sdpa import SdpaAttention
from tokenmill.models.config import FULL, SLIDING, ModelConfig
from tokenmill.models.loader import load_model
from tokenmill.models.registry import HF_FAMILIES

CPU = torch.device("cpu")
FAMILIES = ["qwen3", "mistral", "phi3", "gemma3", "gemma3_head256"]
WINDOWED = ["mistral", "phi3", "gemma3", "gemma3_head256"]
PROMPT = [5, 17, 300, 42, 8, 99, 123, 7, 256, 31, 64, 200, 11, 3, 77, 150, 9, 410, 21, 60]
NEW_TOKENS = 40


def hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n, do_sample=False, eos_token_id=None,
    )
    return out[0, len(prompt):].tolist()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("variant", FAMILIES)
def test_greedy_and_logits_match_hf(tiny_model_dir, variant):
    """40 greedy tokens (prefill in chunks of 6, so windows cut chunks with context) and
    every step's logits against one full Hugging Face forward."""
    model_dir = tiny_model_dir(variant)
    ours, _ = load_model(model_dir, torch.float32, CPU)
    theirs = hf_model(model_dir)
    ref = hf_greedy(theirs, PROMPT, NEW_TOKENS)
    assert greedy_generate(ours, PROMPT, NEW_TOKENS, chunk_size=6) == ref

    runner = PagedRunner(ours, block_size=4)
    steps = [runner.step([(0, PROMPT)])[0]]
    steps += [runner.step([(0, [tok])])[0] for tok in ref[:-1]]
    full = hf_logits(theirs, PROMPT + ref[:-1])
    torch.testing.assert_close(torch.stack(steps), full[len(PROMPT) - 1:], atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("variant", WINDOWED)
def test_the_window_changes_the_output(tiny_model_dir, variant):
    """The tiny windows are short enough to matter: without them the logits differ."""
    model_dir = tiny_model_dir(variant)
    ours, config = load_model(model_dir, torch.float32, CPU)
    assert config.sliding_window is not None and SLIDING in config.layer_types
    windowed = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    # a window longer than the prompt: the same layers (and rotary bases), nothing cut
    ours_full = type(ours)(dataclasses.replace(config, sliding_window=1000), torch.float32,
                           CPU)
    ours_full.load_weights(load_file(f"{model_dir}/model.safetensors").items())
    full = PagedRunner(ours_full).step([(0, PROMPT)], all_tokens=True)
    first_cut = config.sliding_window  # position of the first query its window cuts
    torch.testing.assert_close(windowed[:first_cut], full[:first_cut])
    assert (windowed[first_cut:] - full[first_cut:]).abs().max() > 1e-3


def test_gemma3_layers_and_scales(tiny_model_dir):
    """Gemma 3's config as read: alternating layers, two rotary bases, its q . k scale,
    tied head, tanh-GELU; norms loaded as 1 + weight."""
    model_dir = tiny_model_dir("gemma3")
    ours, config = load_model(model_dir, torch.float32, CPU)
    assert config.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert (config.rope_theta, config.sliding_rope_theta) == (1_000_000.0, 10_000.0)
    assert config.attention_scale == 256**-0.5 and config.tie_word_embeddings
    assert config.hidden_act == "gelu_pytorch_tanh" and config.qk_norm
    stored = load_file(f"{model_dir}/model.safetensors")
    norm = "model.layers.1.post_feedforward_layernorm.weight"
    torch.testing.assert_close(ours.state_dict()[norm], stored[norm] + 1)


def test_qwen2_biases_and_phi3_fused_checkpoint(tiny_model_dir):
    """Qwen2 (and Qwen2.5, the same architecture) carries q/k/v biases and no o_proj bias;
    Phi-3's checkpoint holds the fused projections under our own names."""
    qwen2 = load_model(tiny_model_dir("qwen2"), torch.float32, CPU)[1]
    assert qwen2.attention_bias and not qwen2.o_proj_bias
    stored = load_file(f"{tiny_model_dir('qwen2')}/model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.bias"].abs().max() > 0
    phi3 = load_file(f"{tiny_model_dir('phi3')}/model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in phi3
    assert "model.layers.0.mlp.gate_up_proj.weight" in phi3


@pytest.mark.parametrize("variant", ["gemma3_head256", "gemma3", "mistral"])
def test_native_kernels_path_matches_hf(tiny_model_dir, native, variant):
    """With the native kernels: every layer on ``NativeAttention`` (head 256 on its decode
    kernel; float32 prefills on SDPA), windowed layers' decodes by the kernel with the
    window, their prefills by SDPA with it."""
    model_dir = tiny_model_dir(variant)
    ours, config = load_model(model_dir, torch.float32, CPU, kernels=native)
    for i, backend in enumerate(ours.layer_attentions):
        assert type(backend) is NativeAttention
        assert backend.prefill.window == config.layer_window(i)
    assert len(ours.attentions) == len({config.layer_window(i)
                                        for i in range(config.num_hidden_layers)})
    theirs = hf_model(model_dir)
    ref = hf_greedy(theirs, PROMPT, NEW_TOKENS)
    assert greedy_generate(ours, PROMPT, NEW_TOKENS, chunk_size=6) == ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 40])
def test_native_windowed_decode_matches_exact_attention(native, dtype, head_dim):
    """The kernel's window: each sequence's last ``window`` keys, from a window start in
    mid-block, at a block edge, or before the first key (a short sequence)."""
    window, bs, heads, kv_heads = 7, 4, 4, 2
    gen = torch.Generator().manual_seed(head_dim)
    lens = [30, 9, 3, 28, 7]  # starts 23 (mid-block), 2, 0, 21, 0
    max_blocks, num_seqs = 8, len(lens)
    cache = torch.randn(2, num_seqs * max_blocks, bs, kv_heads, head_dim, generator=gen)
    cache = cache.to(dtype)
    tables = torch.randperm(num_seqs * max_blocks, generator=gen).view(num_seqs, max_blocks)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
    out = native.paged_decode_attention(q, cache[0], cache[1], tables.to(torch.int32),
                                        torch.tensor(lens, dtype=torch.int32),
                                        head_dim**-0.5, window)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for b, seq_len in enumerate(lens):
        rows = torch.tensor([int(tables[b, t // bs]) * bs + t % bs
                             for t in range(max(0, seq_len - window), seq_len)])
        k, v = (cache[i].reshape(-1, kv_heads, head_dim)[rows].double() for i in (0, 1))
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) * head_dim**-0.5
        expected = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out[b].double(), expected, atol=tolerance, rtol=tolerance)


def test_windowed_plans_read_only_the_window():
    """Decodes and prefill chunks of long sequences gather only the blocks holding their
    windows' keys (a block more at most, for a window that starts mid-block)."""
    window, bs, heads, kv_heads, head_dim = 8, 4, 2, 1, 16
    attention = SdpaAttention(heads, kv_heads, head_dim, torch.float32, window=window)
    seq_lens = [100, 37, 30]
    query_lens = [1, 1, 5]  # two decodes, one prefill chunk with context 25
    tables = torch.arange(3 * 25).view(3, 25)
    slots = torch.tensor([int(tables[0, 24]) * bs + 3, int(tables[1, 9]) * bs]
                         + [int(tables[2, p // bs]) * bs + p % bs for p in range(25, 30)])
    md = AttentionMetadata(slot_mapping=slots, query_start_loc=[0, 1, 2, 7],
                           query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
                           block_size=bs)
    plan = attention.plan(md, num_cache_blocks=100)
    decode_blocks = plan.decode.block_ids[: len(plan.decode.block_ids) // 2].view(2, -1)
    assert decode_blocks.shape[1] <= -(-window // bs) + 1
    # seq 0 (len 100) sees positions 92..99: blocks 23 and 24 of its table
    assert decode_blocks[0].tolist()[:2] == tables[0, 23:25].tolist()
    assert decode_blocks[1].tolist()[:3] == tables[1, 7:10].tolist()  # 29..36
    (prefill,) = plan.prefill
    # the first query (position 25) sees 18..25: blocks 4..7 (positions 16..31) are read
    assert prefill.num_keys == 14 and prefill.mask.shape == (5, 14)
    assert prefill.blocks.tolist() == [*tables[2, 4:8].tolist(),
                                       *(tables[2, 4:8] + 100).tolist()]
    visible = prefill.mask == 0
    assert visible[0].nonzero().flatten().tolist() == list(range(2, 10))  # 18..25
    assert visible[4].nonzero().flatten().tolist() == list(range(6, 14))  # 22..29


def test_hf_configs_of_other_layouts():
    """Window switched off by use_sliding_window; Gemma 3's transformers 4.x layout;
    what no family here runs raises ModelLoadError."""
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 4}
    qwen = ModelConfig.from_hf_dict({**base, "architectures": ["Qwen2ForCausalLM"],
                                     "use_sliding_window": False, "sliding_window": 4096},
                                    HF_FAMILIES)
    assert qwen.sliding_window is None and qwen.layer_types == ()
    qwen_swa = ModelConfig.from_hf_dict({**base, "architectures": ["Qwen2ForCausalLM"],
                                         "use_sliding_window": True, "sliding_window": 64,
                                         "max_window_layers": 4}, HF_FAMILIES)
    assert qwen_swa.layer_types == (FULL,) * 4 + (SLIDING,) * 2
    mistral = ModelConfig.from_hf_dict({**base, "architectures": ["MistralForCausalLM"],
                                        "sliding_window": None}, HF_FAMILIES)
    assert mistral.layer_window(0) is None
    gemma = ModelConfig.from_hf_dict({
        **base, "architectures": ["Gemma3ForCausalLM"], "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
        "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }, HF_FAMILIES)
    assert gemma.layer_types == (SLIDING,) * 5 + (FULL,)
    assert gemma.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (gemma.rope_theta, gemma.sliding_rope_theta, gemma.head_dim) == (1e6, 1e4, 256)
    assert gemma.tie_word_embeddings
    for extra, message in [
        ({"architectures": ["Phi3ForCausalLM"],
          "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
         "partial_rotary_factor"),
        ({"architectures": ["Gemma3ForCausalLM"], "final_logit_softcapping": 30.0},
         "final_logit_softcapping"),
        ({"architectures": ["LlamaForCausalLM"], "hidden_act": "relu"}, "'relu'"),
        ({"architectures": ["GPT2LMHeadModel"]}, "Qwen3ForCausalLM"),
    ]:
        with pytest.raises(ModelLoadError, match=message):
            ModelConfig.from_hf_dict({**base, **extra}, HF_FAMILIES)


@pytest.mark.parametrize("variant,arch", [("qwen3", "qwen3"), ("phi3", "phi3"),
                                          ("gemma3_head256", "gemma3")])
def test_gguf_matches_hf(tiny_model_dir, tmp_path, variant, arch):
    """The same checkpoints as GGUF files (``gguf_writer``: llama.cpp's names and
    metadata): same config, same logits. (A GGUF file has no query_pre_attn_scalar:
    llama.cpp takes the head size, which the head-256 Gemma has, as released ones but
    the 27B.)"""
    model_dir = tiny_model_dir(variant)
    path = str(tmp_path / "m.gguf")
    write_gguf(model_dir, path, arch=arch)
    ours, config = load_model(path, torch.float32, CPU)
    hf_config = load_model(model_dir, torch.float32, CPU)[1]
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)  # float32 in GGUF
    assert dataclasses.replace(config, rms_norm_eps=hf_config.rms_norm_eps) == hf_config
    got = PagedRunner(ours).step([(0, PROMPT)], all_tokens=True)
    torch.testing.assert_close(got, hf_logits(hf_model(model_dir), PROMPT), atol=1e-4,
                               rtol=1e-4)


LLAMA_CPP = Path(os.environ.get("PEERS", Path.home() / ".cache/tokenmill-peers")) / "llama.cpp"


def llama_cpp_convert(model_dir: str, path: str) -> str:
    """``model_dir`` converted by llama.cpp's converter into a float32 GGUF file ``path``."""
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("llama_cpp_convert.py")),
         str(LLAMA_CPP), model_dir, "--outfile", path, "--outtype", "f32"],
        check=True, capture_output=True, timeout=300,
    )
    return path


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason=f"no llama.cpp source tree (convert_hf_to_gguf.py) at {LLAMA_CPP}; "
                           "set PEERS to the folder holding llama.cpp/")
@pytest.mark.parametrize("variant", ["qwen3", "mistral_no_window", "phi3", "gemma3_pattern6"])
def test_llama_cpp_converted_gguf_matches_hf(tiny_model_dir, tmp_path, variant):
    """Files made by llama.cpp's own converter load as the same model. (Gemma's converter
    keeps only the tokenizer's rows of the embedding: the logits compared are those.)"""
    model_dir = tiny_model_dir(variant)
    path = llama_cpp_convert(model_dir, str(tmp_path / "m.gguf"))
    ours, config = load_model(path, torch.float32, CPU)
    hf_config = load_model(model_dir, torch.float32, CPU)[1]
    assert config.layer_types == hf_config.layer_types
    assert config.attention_scale == pytest.approx(hf_config.attention_scale)
    prompt = [t for t in PROMPT if t < 400]  # within the tokenizer's vocabulary
    got = PagedRunner(ours).step([(0, prompt)], all_tokens=True)
    ref = hf_logits(hf_model(model_dir), prompt)[:, : got.shape[1]]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
