"""How well a model predicts a text: per-token log-probabilities and perplexity.

Used to measure what a weight format costs in accuracy (``--quantization``): the same
text through two loadings of one model. One prefill over a private paged KV cache, the
same forward pass the engine runs, so what is measured is what is served.
"""

from __future__ import annotations

import math

import torch

from tokenmill.models.attention_metadata import AttentionMetadata

BLOCK_SIZE = 16


@torch.inference_mode()
def token_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """``[n - 1]`` float32: ``log p(token_i | token_0 .. token_{i-1})`` for ``i >= 1``."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    device = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    n = len(token_ids)
    num_blocks = -(-n // BLOCK_SIZE)
    kv_caches = [torch.zeros(model.kv_cache_shape(num_blocks, BLOCK_SIZE), dtype=dtype,
                             device=device) for _ in range(model.config.num_hidden_layers)]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device), query_start_loc=[0, n], query_lens=[n],
        seq_lens=[n], block_tables=torch.arange(num_blocks, device=device)[None],
        block_size=BLOCK_SIZE)
    ids = torch.tensor(token_ids, device=device)
    hidden = model(ids, torch.arange(n, device=device), metadata, kv_caches)
    logprobs = torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1)
    return logprobs.gather(1, ids[1:, None]).squeeze(1).cpu()


def perplexity(model: torch.nn.Module, token_ids: list[int]) -> float:
    """``exp(-mean log p)`` over every token after the first."""
    return math.exp(-token_logprobs(model, token_ids).double().mean().item())
