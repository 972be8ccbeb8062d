"""Embeddings from the generating engine on a tiny float32 Llama: each pooling (last,
mean, cls; normalised or not) equals transformers' final-norm hidden states pooled the
same way, whatever the chunking, beside generation, with prefix-cache hits and after
preemption; no KV block stays taken."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import PoolingParams


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 390) for _ in range(rng.randrange(3, 60))] for _ in range(count)]


@pytest.fixture(scope="module")
def hf_hidden(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return hidden


def expected(hidden: torch.Tensor, pooling: PoolingParams) -> torch.Tensor:
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling.kind]
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector


def check(vectors, batch, pooling, hf_hidden) -> None:
    for vector, ids in zip(vectors, batch, strict=True):
        want = expected(hf_hidden(ids), pooling)
        got = torch.tensor(vector)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.999
        if not pooling.normalize:
            assert torch.allclose(got.norm(), want.norm(), rtol=1e-3)
        else:
            assert abs(float(got.norm()) - 1.0) < 1e-5


SCHEDULES = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 16},
    "preemption": {"num_kv_blocks": 20, "block_size": 4, "max_model_len": 80,
                   "max_num_batched_tokens": 32},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pooling", [PoolingParams(), PoolingParams("mean"),
                                     PoolingParams("cls", normalize=False),
                                     PoolingParams("last", normalize=False)],
                         ids=["last", "mean", "cls-raw", "last-raw"])
def test_vectors_equal_transformers(tiny_model, hf_hidden, schedule, pooling) -> None:
    llm = LLM(tiny_model, dtype="float32", **SCHEDULES[schedule])
    batch = prompts(10)
    check(llm.embed(batch, pooling), batch, pooling, hf_hidden)
    again = llm.embed(batch, pooling)  # prefix-cache hits where the pooling allows them
    check(again, batch, pooling, hf_hidden)
    llm.client.core.check_integrity()


def test_embeddings_share_the_engine_with_generation(tiny_model, hf_hidden) -> None:
    llm = LLM(tiny_model, dtype="float32", max_num_batched_tokens=24)
    batch = prompts(6, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    core = llm.client.core
    for ids in batch:  # generation and pooling requests in the same steps
        llm.client.add_request(llm.processor.make_pooling_request(
            f"embed-{len(ids)}-{ids[0]}", ids, PoolingParams()))
    together = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    assert together == alone
    llm.client.core.check_integrity()
    assert not core.has_work()
