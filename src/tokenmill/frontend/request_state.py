"""Frontend state of one API request: its choices' detokenisers, token counts and
lifecycle events, turning engine-core outputs into ``ChoiceDelta``s.

Invariant: a choice's ``num_output_tokens`` counts exactly the tokens whose text the
client has been (or will be) sent. Stop strings end a choice in the engine core, on the
token that completes one (so no token follows it); the detokeniser here runs the same
match over the same tokens to hold back what may become a stop string and to cut the
text at the one that did. A choice a stop string ended gets that token's delta, then a
finish without a token (``stop``, the string as its ``stop_reason``); where the token
also ended it otherwise (a stop token, ``max_tokens``), one delta carries both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from tokenmill.core.detokenizer import IncrementalDetokenizer
from tokenmill.core.records import FinishReason, RequestCounters, RequestEvent, RequestEventType
from tokenmill.core.request import EngineCoreRequest
from tokenmill.core.types import EngineCoreOutput
from tokenmill.frontend.outputs import ChoiceDelta
from tokenmill.metrics.stats import RequestStats, compute_request_stats
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer.tokenizer import Tokenizer


def open_choices(core_requests: Sequence[EngineCoreRequest], tokenizer: Tokenizer,
                 arrival_ts: float) -> list[ChoiceState]:
    """The choices of one API request (one per engine request, in the API's choice order),
    their lifecycles begun: arrived at ``arrival_ts``, input processed now."""
    events = [RequestEvent(RequestEventType.ARRIVED, arrival_ts),
              RequestEvent(RequestEventType.INPUT_PROCESSED, time.monotonic())]
    return [ChoiceState(i, r.req_id, tokenizer, r.prompt_token_ids, r.sampling_params, events,
                        r.priority)
            for i, r in enumerate(core_requests)]


class ChoiceState:
    def __init__(self, index: int, req_id: str, tokenizer: Tokenizer,
                 prompt_token_ids: Sequence[int], params: SamplingParams,
                 frontend_events: list[RequestEvent], priority: int = 0) -> None:
        self.index = index
        self.req_id = req_id
        self.params = params
        self.priority = priority
        self.num_prompt_tokens = len(prompt_token_ids)
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        self.events = list(frontend_events)
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.stop_reason: str | int | None = None
        self.finished = False
        self.final_output: EngineCoreOutput | None = None

    def process(self, out: EngineCoreOutput) -> tuple[ChoiceDelta, ...]:
        """The deltas for one core output, in order: none when nothing reaches the client,
        two when a stop string ended the choice (see the module docstring)."""
        self.events.extend(out.events)
        self.num_cached_tokens = out.num_cached_tokens
        token_ids = out.new_token_ids
        text = self.detokenizer.add_tokens(token_ids) if token_ids else ""
        self.num_output_tokens += len(token_ids)
        logprobs = out.new_logprobs if out.new_logprobs and token_ids else None
        if not out.finished:
            if not token_ids:
                return ()
            return (ChoiceDelta(self.index, text, token_ids, logprobs, self.num_output_tokens),)
        self.finished = True
        self.final_output = out
        reason = out.finish_reason
        if self.detokenizer.stopped:
            reason, self.stop_reason = FinishReason.STOP, self.detokenizer.stop_reason
        else:
            text += self.detokenizer.flush()
            stop_ids = self.params.stop_token_ids
            if reason is FinishReason.STOP and token_ids and token_ids[-1] in stop_ids:
                self.stop_reason = token_ids[-1]
        if out.stop_string is not None and token_ids:
            return (ChoiceDelta(self.index, text, token_ids, logprobs, self.num_output_tokens),
                    ChoiceDelta(self.index, "", (), None, self.num_output_tokens,
                                finish_reason=reason.value, stop_reason=self.stop_reason))
        return (ChoiceDelta(self.index, text, token_ids, logprobs, self.num_output_tokens,
                            finish_reason=reason.value, stop_reason=self.stop_reason,
                            embedding=out.embedding),)

    def mark_emitted(self, delta: ChoiceDelta) -> ChoiceDelta:
        """Stamp the hand-over of ``delta`` to the client; the final one gets its stats."""
        now = time.monotonic()
        if delta.token_ids:
            self.events.append(RequestEvent(RequestEventType.EMITTED, now, len(delta.token_ids)))
        if not delta.finished:
            return delta
        self.events.append(RequestEvent(RequestEventType.FINISHED_EMITTED, now))
        return replace(delta, stats=self.compute_stats(delta.finish_reason))

    def compute_stats(self, finish_reason: str) -> RequestStats:
        final = self.final_output
        events = [_with_reason(e, FinishReason(finish_reason)) for e in self.events]
        return compute_request_stats(
            events, num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            counters=final.counters if final and final.counters else RequestCounters(),
            priority=self.priority)


def _with_reason(event: RequestEvent, reason: FinishReason) -> RequestEvent:
    """A stop string ends a choice as ``stop`` although the core, which the same token
    also stopped, saw ``length``."""
    if event.type is RequestEventType.FINISHED and event.finish_reason is not reason:
        return replace(event, finish_reason=reason)
    return event
