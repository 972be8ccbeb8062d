"""Ragged mixed batches through the paged path: sequences arrive at different steps, some
prefill in chunks while others decode, on shuffled (non-contiguous) KV blocks. Every logit
row must equal what Hugging Face computes for that sequence alone."""

from __future__ import annotations

import random

import pytest
import torch
from paged_runner import PagedRunner
from transformers import AutoModelForCausalLM

from tokenmill.models.loader import load_model


def run_staggered_batch(model, prompts, chunk_sizes, arrivals, num_new, block_size):
    """Drive all sequences to ``num_new`` greedy tokens; returns (tokens, logits) per seq,
    logits[i][j] being the row that chose seq i's token j. Asserts batches were mixed."""
    runner = PagedRunner(model, num_blocks=128, block_size=block_size, seed=3)
    computed = [0] * len(prompts)
    tokens = [[] for _ in prompts]
    logits = [[] for _ in prompts]
    saw_mixed = False
    step = 0
    while any(len(t) < num_new for t in tokens):
        chunks, owners = [], []
        for i, prompt in enumerate(prompts):
            if step < arrivals[i] or len(tokens[i]) >= num_new:
                continue
            if computed[i] < len(prompt):
                new = prompt[computed[i] : computed[i] + chunk_sizes[i]]
            else:
                new = [tokens[i][-1]]
            computed[i] += len(new)
            chunks.append((i, new))
            owners.append(i)
        lens = [len(c) for _, c in chunks]
        saw_mixed |= 1 in lens and max(lens) > 1
        for i, row in zip(owners, runner.step(chunks), strict=True):
            if computed[i] >= len(prompts[i]):  # the chunk that ends the prompt samples too
                tokens[i].append(int(row.argmax()))
                logits[i].append(row)
        step += 1
    assert saw_mixed, "the schedule must mix prefill chunks with decodes"
    return tokens, logits


@pytest.mark.parametrize("variant,block_size", [
    ("llama", 4), ("qwen2", 16), ("llama3_rope", 8), ("qwen3", 4), ("mistral", 4),
    ("phi3", 16), ("gemma3", 8),
])
def test_mixed_batch_matches_hf_per_sequence(tiny_model_dir, variant, block_size):
    model_dir = tiny_model_dir(variant)
    ours, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(7)
    lengths = [1, 9, 23, 40, 5, 17]
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in lengths]
    chunk_sizes = [1, 4, 7, 16, 5, 17]
    arrivals = [0, 0, 2, 1, 5, 3]
    num_new = 10
    tokens, logits = run_staggered_batch(ours, prompts, chunk_sizes, arrivals, num_new, block_size)
    for prompt, toks, rows in zip(prompts, tokens, logits, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1 :]
        torch.testing.assert_close(torch.stack(rows), ref, atol=1e-4, rtol=1e-4)
        assert toks == ref.argmax(-1).tolist()
