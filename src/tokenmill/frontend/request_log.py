"""Recent requests for the dashboard timeline and ``GET /v1/requests/recent``.

Holds the requests in flight (read live from their ``ChoiceState``) and the last
``capacity`` finished ones, one entry per choice. Runs on the server's event loop, where
the choices' events are appended, so reading needs no lock.

Prompts and outputs are kept only with ``keep_text`` (``tokenmill serve --ui-show-text``):
without it no entry holds or returns any text of a request.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.frontend.request_state import ChoiceState
from tokenmill.metrics.stats import RequestStats
from tokenmill.metrics.timeline import Timeline
from tokenmill.tokenizer.tokenizer import Tokenizer

MAX_TEXT_CHARS = 2000  # of a prompt (its end) or an output (its start), with --ui-show-text


@dataclass(slots=True)
class _Entry:
    request_id: str  # the API request's id (x-request-id when the client sent one)
    choice: ChoiceState
    prompt: str | None
    timeline: Timeline = field(default_factory=Timeline)
    stats: RequestStats | None = None  # once finished
    output: str | None = None  # once finished, with keep_text


class RequestLog:
    def __init__(self, tokenizer: Tokenizer, capacity: int = 200, keep_text: bool = False) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.keep_text = keep_text
        self._live: dict[str, _Entry] = {}  # by engine request id, in arrival order
        self._finished: deque[_Entry] = deque(maxlen=capacity)

    def started(self, request_id: str, choices: list[ChoiceState],
                prompts: list[list[int]]) -> None:
        """An API request was admitted; ``prompts[i]`` is the prompt of choice ``i``."""
        for choice, prompt_ids in zip(choices, prompts, strict=True):
            prompt = None
            if self.keep_text:
                prompt = self.tokenizer.decode(prompt_ids)[-MAX_TEXT_CHARS:]
            self._live[choice.req_id] = _Entry(request_id, choice, prompt)

    def finished(self, choice: ChoiceState, stats: RequestStats) -> None:
        entry = self._live.pop(choice.req_id, None)
        if entry is None:
            return
        entry.timeline.feed(choice.events)
        entry.stats = stats
        if self.keep_text:
            entry.output = choice.detokenizer.output_text[:MAX_TEXT_CHARS]
        self._finished.append(entry)

    def recent(self, limit: int) -> list[dict]:
        """The ``limit`` most recently arrived requests, newest first, as JSON objects with
        times in seconds since the epoch."""
        live = list(self._live.values())[-limit:]
        entries = live[::-1] + list(self._finished)[::-1][:max(0, limit - len(live))]
        to_wall = time.time() - time.monotonic()
        return [self._describe(e, to_wall) for e in entries]

    def _describe(self, entry: _Entry, to_wall: float) -> dict:
        tl, choice, stats = entry.timeline, entry.choice, entry.stats
        if stats is None:
            tl.feed(choice.events)

        def wall(ts: float | None) -> float | None:
            return None if ts is None else round(ts + to_wall, 4)

        ttft = stats.time_to_first_token if stats else tl.time_to_first_token
        out = {
            "id": entry.request_id,
            "choice": choice.index,
            "status": tl.status(stats.finish_reason if stats else None),
            "finish_reason": stats.finish_reason.value if stats and stats.finish_reason else None,
            "arrival_time": wall(tl.arrival),
            "first_token_time": wall(tl.first_emitted),
            "end_time": wall(tl.end),
            "segments": [{"state": s.state, "start": wall(s.start), "end": wall(s.end)}
                         for s in tl.segments],
            "prompt_tokens": choice.num_prompt_tokens,
            "output_tokens": choice.num_output_tokens,
            "cached_tokens": choice.num_cached_tokens,
            "preemptions": tl.num_preemptions,
            "priority": choice.priority,
            "ttft": ttft,
            "tpot": stats.time_per_output_token if stats else None,
            "e2e": stats.e2e_latency if stats else None,
        }
        if self.keep_text:
            out["prompt"] = entry.prompt
            out["output"] = (entry.output if stats
                             else choice.detokenizer.output_text[:MAX_TEXT_CHARS])
        return out
