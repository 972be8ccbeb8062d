"""A deterministic stand-in for the model runner, for torch-free engine-core tests.

The "model" continues any sequence with ``(sum of its tokens) % vocab``: the next token
depends on the whole context, so a scheduling bug that feeds wrong tokens shows up in
the output, and the same prompt always yields the same continuation. Another rule can
be passed as ``next_token``. Speculative drafts are verified as the real runner does:
the model's token at each position, accepted while it equals the draft. An embedding
request's "hidden state" at a position is ``[token, 1.0]``, pooled as the real runner
pools (``fake_pooled``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.core.engine_core import EngineCore
from tokenmill.core.records import SchedulerStats
from tokenmill.core.request import EngineCoreRequest
from tokenmill.core.types import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

VOCAB = 1000
EOS = 999


def sum_model(sequence: Sequence[int]) -> int:
    return sum(sequence) % VOCAB


def expected_continuation(prompt: list[int], num_tokens: int,
                          next_token: Callable[[Sequence[int]], int] = sum_model) -> list[int]:
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class FakeExecutor:
    """Keeps a fake KV cache: the token id stored in each (block, offset) slot.

    Each step reads a request's earlier context back through its block table, exactly
    as attention would, so a wrong block table or a bad prefix-cache hit changes the
    output.
    """

    def __init__(self, block_size: int, tokens_per_step: int = 1,
                 next_token: Callable[[Sequence[int]], int] = sum_model,
                 window: int | None = None) -> None:
        self.block_size = block_size
        self.tokens_per_step = tokens_per_step  # > 1: as if speculative drafts were accepted
        self.next_token = next_token
        # a sliding window: reads only the positions the first new token can see (pass a
        # ``next_token`` that looks at the last ``window`` tokens only)
        self.window = window
        self.slots: dict[tuple[int, int], int] = {}
        self.steps: list[SchedulerOutput] = []

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(scheduler_output)
        bs = self.block_size
        sampled = {}
        pooled = {item.req_id: part for item in scheduler_output.requests
                  if (part := fake_pooled(item)) is not None}
        for item in scheduler_output.requests:
            first = 0 if self.window is None else max(0, item.start_pos - self.window + 1)
            context = [self.slots[(item.block_ids[p // bs], p % bs)]
                       for p in range(first, item.start_pos)]
            for offset, token in enumerate(item.token_ids):
                p = item.start_pos + offset
                self.slots[(item.block_ids[p // bs], p % bs)] = token
            if item.sample:
                drafts = item.draft_token_ids
                sequence = context + list(item.token_ids[:len(item.token_ids) - len(drafts)])
                new = [self.next_token(sequence)]
                for draft in drafts:
                    if new[-1] != draft:
                        break
                    new.append(self.next_token(sequence + new))
                while len(new) < self.tokens_per_step:
                    new.append(self.next_token(sequence + new))
                sampled[item.req_id] = tuple(new)
        return ModelRunnerOutput(sampled=sampled, forward_time=0.001, pooled=pooled)


def fake_pooled(item) -> list[float] | None:
    """This chunk's share of the pooled vector, where the hidden state at a position
    holding token t is ``[t, 1.0]`` (the model runner's ``_pool``, on that model)."""
    pooling = item.pooling
    if pooling is None:
        return None
    rows = [[float(t), 1.0] for t in item.token_ids]
    if pooling.kind == "mean":
        return [sum(r[0] for r in rows), float(len(rows))]
    if pooling.kind == "cls" and item.start_pos == 0:
        return rows[0]
    if pooling.kind == "last" and item.start_pos + len(rows) == len(item.prompt_token_ids):
        return rows[-1]
    return None


_ids = itertools.count()


def make_request(prompt: list[int], max_tokens: int = 8, group_id: str | None = None,
                 priority: int = 0, **params) -> EngineCoreRequest:
    return EngineCoreRequest(
        req_id=f"req-{next(_ids)}",
        prompt_token_ids=tuple(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **{"ignore_eos": True, **params}),
        eos_token_ids=frozenset({EOS}),
        group_id=group_id,
        priority=priority,
    )


def make_core(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256,
              tokens_per_step: int = 1, next_token: Callable[[Sequence[int]], int] = sum_model,
              window: int | None = None,
              on_scheduled: Callable[[SchedulerStats], None] | None = None,
              **options) -> EngineCore:
    """``window``: a model whose every layer has that sliding window (the KV cache drops
    what is behind it, and the fake model reads only what is in it). ``on_scheduled``:
    the core's hook; ``options``: the ``EngineConfig``'s."""
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **options)
    return EngineCore(config, FakeExecutor(block_size, tokens_per_step, next_token, window),
                      num_blocks, max_model_len, window, on_scheduled)


@dataclass
class Run:
    """What stepping a core until idle gave: each request's committed tokens, its final
    output, and the preemptions the steps reported."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, EngineCoreOutput] = field(default_factory=dict)
    preemptions: int = 0


def run_steps(core: EngineCore, max_steps: int = 10_000) -> Run:
    """Step until idle, checking the KV cache's integrity after every step."""
    run = Run()
    for _ in range(max_steps):
        if not core.has_work():
            core.check_integrity()
            return run
        out = core.step()
        if out.iteration_stats:
            run.preemptions += out.iteration_stats.num_preemptions
        for o in out.outputs:
            run.tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                run.finished[o.req_id] = o
        core.kv.check_integrity()
    raise AssertionError("engine did not go idle")


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until idle; return each request's committed tokens, checking integrity."""
    return run_steps(core, max_steps).tokens
