"""SchedulerOutput -> tensors -> model -> sampler -> ModelRunnerOutput.

Owns the device, the model and the paged KV cache tensors. It keeps no per-request
state: seeded sampling derives its noise from (seed, output position), so preemption
and recompute need nothing from here.

The flat batch lays the scheduled requests' new tokens end to end::

    input_ids:  | r0: token_ids | r1: token_ids | ... |
    positions:  | start_pos ..  | start_pos ..  | ... |
    logits are taken at the last token of every request scheduled with ``sample``, and
    at each of its draft tokens' positions before (see spec_decode.py); an embedding
    request's rows (``pooling``) are pooled instead (``ModelRunnerOutput.pooled``).

Invariant: a position's arithmetic depends on what it is, not on what else the step
holds. Prompt positions take the prefill attention; output positions the decode attention,
one row each, whether decoded, verified as a draft or recomputed after preemption
(``AttentionMetadata.prefill_lens``); the projections compute each row alone at a decode
or verify step's sizes (``models.weights.formats``). So a request's tokens are the same alone, in
any batch of decodes and with or without speculation. With ``batch_invariant`` the
projections are native (each row alone at every size) and, where the prefill attention is
not row-invariant (``PrefillAttention.row_invariant``), prompt positions take the decode
attention too: then also at any chunk boundary, with prefix-cache hits and after
preemption (``docs/speculative.md``).
"""

from __future__ import annotations

import time

import torch

from tokenmill.core.spec_decode import accept_drafts, verify_rows
from tokenmill.core.types import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.engine.sampler import Sampler, SamplingBatch
from tokenmill.engine.sampling_batch import grammar_bitmask
from tokenmill.kernels import NativeKernels
from tokenmill.models.attention.metadata import AttentionMetadata


class ModelRunner:
    """``kernels``: the engine's native kernels (the model's, which its sampler uses
    too), or None for PyTorch's ops; ``batch_invariant``: prompt positions too take the
    decode attention where the model's prefill attention is not row-invariant;
    ``kv_int8``: the KV cache in 8-bit rows (``kv_int8``), else in ``dtype``."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 num_kv_blocks: int, block_size: int, seed: int = 0,
                 kernels: NativeKernels | None = None, batch_invariant: bool = False,
                 kv_int8: bool = False) -> None:
        self.model = model
        self.prompts_by_prefill = (not batch_invariant or all(
            attention.prefill.row_invariant for attention in model.attentions))
        self.device = device
        self.block_size = block_size
        shape = model.kv_cache_shape(num_kv_blocks, block_size, kv_int8)
        cache_dtype = torch.int8 if kv_int8 else dtype
        self.kv_caches = [torch.zeros(shape, dtype=cache_dtype, device=device)
                          for _ in range(model.config.num_hidden_layers)]
        self.sampler = Sampler(kernels)
        self.vocab_size = model.config.vocab_size
        torch.manual_seed(seed)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.monotonic()
        with torch.inference_mode():
            input_ids, positions, metadata, sample_rows = self._prepare(scheduler_output.requests)
            hidden = self.model(input_ids, positions, metadata, self.kv_caches)
            pooled = _pool(scheduler_output.requests, metadata.query_start_loc, hidden)
            sampled: dict[str, tuple[int, ...]] = {}
            logprobs = {}
            if sample_rows:
                # A request with k drafts samples its last 1 + k positions.
                rows = [index + j for index, item in sample_rows
                        for j in range(1 + len(item.draft_token_ids))]
                items = [item for _, item in sample_rows]
                logits = self.model.compute_logits(hidden[rows], widen=False)
                result = self.sampler(logits, self._sampling_batch(items))
                sampled, logprobs = accept_drafts(items, result.token_ids, result.logprobs)
        return ModelRunnerOutput(sampled, logprobs, forward_time=time.monotonic() - start,
                                 pooled=pooled)

    def _prepare(self, requests: tuple[ScheduledRequest, ...]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        query_lens, seq_lens, prefill_lens, sample_rows = [], [], [], []
        max_blocks = max(len(item.block_ids) for item in requests)
        tables = []
        for item in requests:
            n = len(item.token_ids)
            input_ids.extend(item.token_ids)
            pos = range(item.start_pos, item.start_pos + n)
            positions.extend(pos)
            blocks = item.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            query_start_loc.append(query_start_loc[-1] + n)
            query_lens.append(n)
            seq_lens.append(item.start_pos + n)
            # prompt positions to the prefill attention, output positions to the decode one
            prompt_left = len(item.prompt_token_ids) - item.start_pos
            prefill_lens.append(min(max(prompt_left, 0), n) if self.prompts_by_prefill else 0)
            tables.append(list(blocks) + [0] * (max_blocks - len(blocks)))
            if item.sample:
                sample_rows.append((query_start_loc[-1] - 1 - len(item.draft_token_ids), item))
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=query_start_loc,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
            block_size=bs,
            prefill_lens=prefill_lens,
        )
        return (torch.tensor(input_ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device), metadata, sample_rows)

    def _sampling_batch(self, items: list[ScheduledRequest]) -> SamplingBatch:
        rows = verify_rows(items)
        return SamplingBatch.build(
            rows.params, self.vocab_size, self.device,
            prompt_token_ids=rows.prompt_token_ids,
            output_token_ids=rows.output_token_ids,
            banned_token_ids=rows.banned_token_ids,
            grammar=grammar_bitmask(items, self.vocab_size),  # structured outputs' masks
        )


def _pool(requests: tuple[ScheduledRequest, ...], query_start_loc: list[int],
          hidden: torch.Tensor) -> dict[str, list[float]]:
    """Each embedding request's share of its pooled vector from this chunk's rows of
    ``hidden`` (after the final norm), in float32 (see ``ModelRunnerOutput.pooled``)."""
    pooled: dict[str, list[float]] = {}
    for item, begin, end in zip(requests, query_start_loc[:-1], query_start_loc[1:],
                                strict=True):
        pooling = item.pooling
        if pooling is None:
            continue
        if pooling.kind == "mean":
            pooled[item.req_id] = hidden[begin:end].float().sum(dim=0).tolist()
        elif pooling.kind == "cls" and item.start_pos == 0:
            pooled[item.req_id] = hidden[begin].float().tolist()
        elif pooling.kind == "last" and item.start_pos + end - begin == len(
                item.prompt_token_ids):
            pooled[item.req_id] = hidden[end - 1].float().tolist()
    return pooled
