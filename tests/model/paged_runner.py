"""A minimal driver of a model's paged forward pass, for tests (no scheduler, no sampler).

``PagedRunner.step`` takes, for each sequence of the batch, the tokens it adds this step
(a prompt chunk or one decode token), assigns KV blocks from a shuffled free list (so a
sequence's blocks are neither contiguous nor ordered), builds the ``AttentionMetadata``
exactly as its docstring lays out, and returns the logits of each chunk's last token.

The KV cache starts filled with large random values: a read of any slot the batch did not
write (padding, another sequence's block) shows up as a wrong logit. With ``kv_int8`` the
cache holds 8-bit rows (``kv_int8``), of such values too.
"""

from __future__ import annotations

import random

import torch

from tokenmill.models.attention.kv_int8 import quantize_rows
from tokenmill.models.attention.metadata import AttentionMetadata


class PagedRunner:
    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, seed: int = 0,
                 kv_int8: bool = False):
        gen = torch.Generator().manual_seed(seed)
        dtype = model.dtype
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.kv_caches = [
            (torch.randn(shape, generator=gen) * 100).to(dtype)
            for _ in range(model.config.num_hidden_layers)
        ]
        if kv_int8:
            self.kv_caches = [quantize_rows(cache) for cache in self.kv_caches]
        self.model = model
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]], all_tokens: bool = False,
             verify: bool = False) -> torch.Tensor:
        """Run one forward over ``[(seq_id, new_token_ids), ...]``: the logits ``[B, V]`` of
        each chunk's last token, or ``[T, V]`` of every token with ``all_tokens``; with
        ``verify`` every new token is a decode row (a speculative verification's), else a
        chunk of several tokens is a prefill."""
        input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
        for seq_id, tokens in chunks:
            start = self.seq_lens.get(seq_id, 0)
            table = self.block_tables.setdefault(seq_id, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            bs = self.block_size
            slots += [table[pos // bs] * bs + pos % bs for pos in range(start, end)]
            input_ids += tokens
            positions += range(start, end)
            query_start_loc.append(query_start_loc[-1] + len(tokens))
            seq_lens.append(end)
            self.seq_lens[seq_id] = end
        tables = [self.block_tables[s] for s, _ in chunks]
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=query_start_loc,
            query_lens=[len(t) for _, t in chunks],
            seq_lens=seq_lens,
            block_tables=torch.tensor(tables),
            block_size=self.block_size,
            prefill_lens=[0] * len(chunks) if verify else None,
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids), torch.tensor(positions), md, self.kv_caches
            )
            if not all_tokens:
                hidden = hidden[torch.tensor(query_start_loc[1:]) - 1]
            return self.model.compute_logits(hidden)


def greedy_generate(
    model, prompt: list[int], max_new_tokens: int, chunk_size: int | None = None
) -> list[int]:
    """Greedy tokens for one prompt: prefill (in chunks of ``chunk_size``), then decode."""
    runner = PagedRunner(model)
    chunk_size = chunk_size or len(prompt)
    for i in range(0, len(prompt), chunk_size):
        logits = runner.step([(0, prompt[i : i + chunk_size])])
    out = [int(logits[0].argmax())]
    while len(out) < max_new_tokens:
        out.append(int(runner.step([(0, [out[-1]])])[0].argmax()))
    return out
