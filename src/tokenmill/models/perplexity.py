"""How well a model predicts a text: per-token log-probabilities and perplexity.

Used to measure what a weight format (``--quantization``) or an 8-bit KV cache
(``--kv-cache-dtype int8``) costs in accuracy: the same text through two loadings of one
model, or through one with either cache. One prefill over a private paged KV cache, the
same forward pass the engine runs, so what is measured is what is served.
"""

from __future__ import annotations

import math

import torch

from tokenmill.models.attention_metadata import AttentionMetadata

BLOCK_SIZE = 16


@torch.inference_mode()
def next_token_logprobs(model: torch.nn.Module, token_ids: list[int],
                        kv_int8: bool = False) -> torch.Tensor:
    """``[n - 1, V]`` float32: the log-probabilities of every next token after each of
    ``token_ids[:-1]``, given the tokens before it (read from an 8-bit KV cache where
    ``kv_int8``)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    device = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    n = len(token_ids)
    num_blocks = -(-n // BLOCK_SIZE)
    shape = model.kv_cache_shape(num_blocks, BLOCK_SIZE, kv_int8)
    kv_caches = [torch.zeros(shape, dtype=torch.int8 if kv_int8 else dtype, device=device)
                 for _ in range(model.config.num_hidden_layers)]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device), query_start_loc=[0, n], query_lens=[n],
        seq_lens=[n], block_tables=torch.arange(num_blocks, device=device)[None],
        block_size=BLOCK_SIZE)
    ids = torch.tensor(token_ids, device=device)
    hidden = model(ids, torch.arange(n, device=device), metadata, kv_caches)
    return torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1).cpu()


def mean_kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of ``KL(reference || other)`` in nats, for two
    ``next_token_logprobs`` of the same text: how far ``other``'s predictions are from
    ``reference``'s (0 when equal). Less noisy than a perplexity difference on a short
    text, whose sign can go either way."""
    return (reference.exp() * (reference - other)).sum(-1).mean().item()


def perplexity(model: torch.nn.Module, token_ids: list[int]) -> float:
    """``exp(-mean log p)`` over every token after the first."""
    return perplexity_of(next_token_logprobs(model, token_ids), token_ids)


def perplexity_of(logprobs: torch.Tensor, token_ids: list[int]) -> float:
    """``perplexity`` from the text's ``next_token_logprobs``."""
    chosen = logprobs.gather(1, torch.tensor(token_ids[1:])[:, None])
    return math.exp(-chosen.double().mean().item())
