"""Speculative decoding on the real embedded model (SmolLM2-135M-Instruct) in the host's
default dtype (``dtype="auto"``: bfloat16 on a CPU with AVX512-BF16, float32 elsewhere)
and every quantization this host runs: with drafts accepted, greedy and seeded outputs are
the same tokens, one for one, as without speculation.

One engine per quantization serves both sides: a batch of more requests than
``speculative_disable_by_batch_size`` never drafts (the reference), a batch of fewer
drafts in every step it can. (The batches differ too: the outputs must not care.)"""

from __future__ import annotations

import pytest

from quantization_hosts import host, runs_here
from tokenmill import LLM, SamplingParams
from tokenmill.models.weights.quantizations import resolve_dtype

# Repetitive text: lookups find drafts and the model accepts many of them.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat this list exactly, three times: apple, pear, plum, fig, lime, kiwi.",
    "one two three four five one two three four five one two three",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)
PARAMS = [GREEDY, SEEDED, GREEDY]
# Up to 3 running requests draft; a batch of 6 never does.
ENGINE = {"speculative_ngram": 4, "speculative_disable_by_batch_size": 3,
          "kv_cache_memory": "32MiB", "max_model_len": 256}


@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "w4a8", "w8a8"])
def test_speculation_gives_the_same_tokens_in_the_default_dtype(quantization) -> None:
    device, capabilities = host()
    dtype = resolve_dtype("auto", device, quantization)
    if not runs_here(quantization, dtype, capabilities, device):  # checked before building
        pytest.skip(f"this host has no kernel for --quantization {quantization} in {dtype}")
    llm = LLM(dtype="auto", quantization=quantization, **ENGINE)  # a refusal fails
    plain = [o.outputs[0] for o in llm.generate(PROMPTS * 2, PARAMS * 2)]
    spec = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
    assert sum(o.stats.num_draft_tokens for o in plain) == 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain[:3]]
    assert [o.token_ids for o in plain[3:]] == [o.token_ids for o in plain[:3]]
    assert sum(o.stats.num_accepted_tokens for o in spec) >= 10  # drafts did the work
