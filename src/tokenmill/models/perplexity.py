"""How well a model predicts a text: per-token log-probabilities and perplexity.

Used to measure what a weight format (``--quantization``) or an 8-bit KV cache
(``--kv-cache-dtype int8``) costs in accuracy: the same text through two loadings of one
model, or through one with either cache. One prefill over a private paged KV cache, the
same forward pass the engine runs, so what is measured is what is served; or a prefill
of the text's start and then one decode step per token, as an output is computed.
"""

from __future__ import annotations

import math

import torch

from tokenmill.models.attention.metadata import AttentionMetadata

BLOCK_SIZE = 16


@torch.inference_mode()
def next_token_logprobs(model: torch.nn.Module, token_ids: list[int],
                        kv_int8: bool = False, decode_from: int | None = None) -> torch.Tensor:
    """``[n - 1, V]`` float32: the log-probabilities of every next token after each of
    ``token_ids[:-1]``, given the tokens before it (read from an 8-bit KV cache where
    ``kv_int8``); with ``decode_from``, the first that many tokens in one prefill and
    each later one in a decode step of its own (its own attention kernel: the decode's)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    device = model.model.norm.weight.device
    dtype = model.dtype
    n = len(token_ids)
    num_blocks = -(-n // BLOCK_SIZE)
    shape = model.kv_cache_shape(num_blocks, BLOCK_SIZE, kv_int8)
    kv_caches = [torch.zeros(shape, dtype=torch.int8 if kv_int8 else dtype, device=device)
                 for _ in range(model.config.num_hidden_layers)]
    ids = torch.tensor(token_ids, device=device)
    steps = [(0, n)] if decode_from is None else [(0, decode_from)] + [
        (i, i + 1) for i in range(decode_from, n)]
    hidden = torch.cat([_forward(model, ids, start, end, kv_caches) for start, end in steps])
    return torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1).cpu()


def _forward(model: torch.nn.Module, ids: torch.Tensor, start: int, end: int,
             kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """The hidden states of tokens ``start .. end - 1`` of one sequence whose earlier
    tokens are in ``kv_caches`` (blocks 0, 1, ... in order)."""
    device = ids.device
    positions = torch.arange(start, end, device=device)
    metadata = AttentionMetadata(
        slot_mapping=positions, query_start_loc=[0, end - start], query_lens=[end - start],
        seq_lens=[end], block_tables=torch.arange(kv_caches[0].shape[1], device=device)[None],
        block_size=BLOCK_SIZE)
    return model(ids[start:end], positions, metadata, kv_caches)


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
