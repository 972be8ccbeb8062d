"""One request's grammar state, and the allowed-token bitmasks of a step.

Invariant: a ready ``RequestGrammar`` has consumed exactly the request's output tokens
(``num_tokens == len(output_token_ids)``): the scheduler feeds it each token it commits.
Its state lives on the engine's ``Request``, which a preemption keeps (with its output),
so the grammar needs nothing on recompute; ``sync`` replays the output into a fresh
matcher should the two ever disagree.

A bitmask row holds one bit per token of the model's vocabulary (32 tokens per int32,
token t at bit t % 32 of word t // 32): 1 where the grammar allows the token next.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future

import llguidance
import numpy as np

from tokenmill.structured.grammar import GrammarError


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class RequestGrammar:
    """A request's grammar: compiling at first, then its own matcher."""

    def __init__(self, compiled: Future, deadline: float, timeout_s: float) -> None:
        self._compiled = compiled
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._template: llguidance.LLMatcher | None = None
        self.matcher: llguidance.LLMatcher | None = None
        self.num_tokens = 0  # output tokens consumed

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    @property
    def deadline(self) -> float:
        """When a compilation still running fails (``time.monotonic()``)."""
        return self._deadline

    def poll(self) -> bool:
        """Whether the grammar is ready; raises ``GrammarError`` when its compilation
        failed or has run past the compile timeout."""
        if self.matcher is not None:
            return True
        if self._compiled.done():
            error = self._compiled.exception()
            if error is not None:
                raise error if isinstance(error, GrammarError) else GrammarError(str(error))
            self._template = self._compiled.result()
            self.matcher = self._template.deep_copy()
            return True
        if time.monotonic() > self._deadline:
            raise GrammarError(f"the grammar took longer than {self._timeout_s:g} s to compile "
                               "(the engine's --structured-output-compile-timeout)")
        return False

    def accept(self, token_id: int) -> bool:
        """Consume a committed token; False when the grammar rejects it (the matcher is
        then in an error state, and the request must end)."""
        assert self.matcher is not None, "a request runs only once its grammar is ready"
        self.num_tokens += 1
        return self.matcher.consume_token(token_id)

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher is not None else ""

    def is_finished(self) -> bool:
        """The grammar is complete and admits no further token (but EOS)."""
        assert self.matcher is not None
        return self.matcher.is_stopped()

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts`` (speculative tokens) to keep: the longest prefix the
        grammar accepts that does not complete it (the token that completes the grammar is
        sampled, never drafted, so no verified row samples past the grammar's end)."""
        assert self.matcher is not None
        valid = self.matcher.validate_tokens(list(drafts))
        keep = consumed = 0
        for token_id in drafts[:valid]:
            self.matcher.consume_token(token_id)
            consumed += 1
            if self.matcher.is_stopped():
                break
            keep += 1
        if consumed:
            self.matcher.rollback(consumed)
        return keep

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher's state that of ``output_token_ids`` (a no-op when it is)."""
        assert self._template is not None and self.matcher is not None
        if self.num_tokens == len(output_token_ids):
            return
        self.matcher = self._template.deep_copy()
        self.num_tokens = 0
        for token_id in output_token_ids:
            self.accept(token_id)


def fill_bitmasks(entries: Sequence[tuple[RequestGrammar, int, Sequence[int]]],
                  bitmask: np.ndarray) -> None:
    """Fill rows of ``bitmask`` ([rows, bitmask_width(vocab)] int32, C-contiguous) from
    ``entries`` of (grammar, first row, draft tokens): row ``first`` gets the mask after
    the request's output, row ``first + j`` the mask after its drafts 1..j as well (for
    speculative verification; the drafts are the grammar's own, ``valid_drafts``).

    Serially, on the calling thread (outside the GIL): llguidance's parallel executor
    keeps worker threads spinning after each batch, which on a small machine take the
    cores the model's own threads need; a mask costs tens of microseconds per row."""
    assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"] and bitmask.ndim == 2
    row_bytes = bitmask.shape[1] * 4
    base = bitmask.ctypes.data
    for grammar, first, drafts in entries:
        matcher = grammar.matcher
        assert matcher is not None and first + len(drafts) < bitmask.shape[0]
        matcher.unsafe_compute_mask_ptr(base + first * row_bytes, row_bytes)
        for j, token_id in enumerate(drafts, 1):
            ok = matcher.consume_token(token_id)
            assert ok, "drafts are cut to what the grammar accepts"
            matcher.unsafe_compute_mask_ptr(base + (first + j) * row_bytes, row_bytes)
        if drafts:
            matcher.rollback(len(drafts))
