"""The broader promise, as a property: a request's tokens are the same alone, in a batch,
split by chunked prefill at any boundary, with or without prefix-cache hits, after
preemption and recompute, and with or without speculation (``docs/speculative.md``).

Seeded random draws of schedules (batch mates and their order, token budget, KV blocks
scarce enough to preempt, block size, prefix cache, speculation) run tiny random-weight
models in the host's default dtype with ``batch_invariant`` on, and every request's
tokens must equal those it gets alone. Two models: one whose heads the native prefill
attention takes (64), one whose heads it does not (16: prompts take the decode attention).
"""

from __future__ import annotations

import random

import pytest

from quantization_hosts import batch_invariant_here, host
from tiny_model import make_tiny_model_dir
from tokenmill import LLM, SamplingParams
from tokenmill.models.weights.quantizations import resolve_dtype

MODELS = {"heads_of_64": {"hidden_size": 128, "num_attention_heads": 2,
                          "num_key_value_heads": 1, "intermediate_size": 256},
          "heads_of_16": {}}
MAX_MODEL_LEN = 64
NUM_SCHEDULES = 12


def requests(rng: random.Random, count: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of repeated phrases (drafts get accepted), some sharing a prefix (cache
    hits); greedy or seeded sampling."""
    shared = [rng.randrange(3, 400) for _ in range(12)]
    out = []
    for i in range(count):
        phrase = [rng.randrange(3, 400) for _ in range(rng.randrange(2, 6))]
        prompt = (shared if i % 3 == 0 else []) + phrase * rng.randrange(2, 5)
        params = SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i,
                                max_tokens=rng.randrange(8, 20), ignore_eos=True)
        out.append((prompt[:MAX_MODEL_LEN - 20], params))
    return out


def engine(model: str, **options) -> LLM:
    """An engine of ``batch_invariant`` (a refusal fails the test: ``test_tokens_...``
    checks that the host runs it before building)."""
    return LLM(model, dtype="auto", batch_invariant=True, max_model_len=MAX_MODEL_LEN,
               **options)


def draw_schedule(rng: random.Random) -> dict:
    block_size = rng.choice([4, 8, 16])
    one_sequence = MAX_MODEL_LEN // block_size
    schedule = {
        "block_size": block_size,
        # from barely one sequence's blocks (preemption) to plenty
        "num_kv_blocks": rng.choice([one_sequence + 2, one_sequence * 2, one_sequence * 8]),
        "max_num_batched_tokens": rng.choice([5, 8, 13, 32, 256]),
        "max_num_seqs": rng.choice([2, 5, 16]),
        "enable_prefix_caching": rng.random() < 0.7,
    }
    if rng.random() < 0.6:
        schedule |= {"speculative_ngram": rng.choice([1, 3, 5]), "ngram_min": 1,
                     "speculative_disable_by_batch_size": 16}
    return schedule


@pytest.mark.parametrize("variant", MODELS)
def test_tokens_do_not_depend_on_the_schedule(tmp_path, variant) -> None:
    device, capabilities = host()
    dtype = resolve_dtype("auto", device)
    if not batch_invariant_here(dtype, capabilities, device):
        pytest.skip(f"this host has no native linear kernels for {dtype}: no batch_invariant")
    model = make_tiny_model_dir(tmp_path, **MODELS[variant])
    rng = random.Random(variant)
    batch = requests(rng, 10)
    alone = engine(model, num_kv_blocks=4 * MAX_MODEL_LEN // 16, enable_prefix_caching=False)
    reference = [alone.generate([p], params)[0].outputs[0].token_ids for p, params in batch]
    preempted = drafted = 0
    for _ in range(NUM_SCHEDULES):
        schedule = draw_schedule(rng)
        order = rng.sample(range(len(batch)), rng.randrange(3, len(batch) + 1))
        llm = engine(model, **schedule)
        outputs = llm.generate([batch[i][0] for i in order], [batch[i][1] for i in order])
        for i, output in zip(order, outputs, strict=True):
            assert output.outputs[0].token_ids == reference[i], (schedule, i)
        llm.client.core.check_integrity()
        preempted += sum(o.outputs[0].stats.num_preemptions for o in outputs)
        drafted += sum(o.outputs[0].stats.num_accepted_tokens for o in outputs)
    assert preempted and drafted, (preempted, drafted)  # the draws did both
