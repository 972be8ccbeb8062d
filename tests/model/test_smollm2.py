"""The embedded SmolLM2 GGUF, run by tokenmill, against transformers' own GGUF loader:
3 chat prompts, batched together through the paged path, 32 greedy tokens each."""

from __future__ import annotations

import os

import pytest
import torch
from paged_runner import PagedRunner
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tokenmill.models.loader import default_model_path, load_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]
NUM_NEW = 32


def hf_reference(path: str) -> LlamaForCausalLM:
    """transformers dequantizes the same file (without its accelerate-only entry point)."""
    folder, name = os.path.split(path)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(folder, gguf_file=name)).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert result.missing_keys == ["lm_head.weight"]  # tied to the embedding
    model.tie_weights()
    return model


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers():
    path = default_model_path()
    ours, config = load_model(None, torch.float32, torch.device("cpu"))
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]

    runner = PagedRunner(ours, num_blocks=64, block_size=16)
    rows = [runner.step(list(enumerate(prompts)))]  # three prefills in one batch
    tokens = [[int(t)] for t in rows[0].argmax(-1)]
    while len(tokens[0]) < NUM_NEW:  # ragged batched decode
        rows.append(runner.step([(i, [t[-1]]) for i, t in enumerate(tokens)]))
        for t, row in zip(tokens, rows[-1], strict=True):
            t.append(int(row.argmax()))
    assert "Paris" in tokenizer.decode(tokens[0])

    reference = hf_reference(path)
    for i, (prompt, toks) in enumerate(zip(prompts, tokens, strict=True)):
        # NOTE: an explicit mask; generate() would otherwise mask the prompt's <|im_end|>
        # tokens, which share their id with the pad token.
        expected = reference.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None,
        )[0, len(prompt) :].tolist()
        assert toks == expected, f"prompt {i}"
        with torch.no_grad():
            full = reference(torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1 :]
        ours_rows = torch.stack([step[i] for step in rows])
        torch.testing.assert_close(ours_rows, full, atol=2e-3, rtol=1e-3)
