"""One request's lifecycle as phases on a time axis, for the dashboard's timeline.

Standard library only. ``Timeline.feed(events)`` reads a request's events (the list a
``ChoiceState`` keeps, frontend and core events in arrival order) and turns them into
segments, each one phase::

    events:   ARRIVED  QUEUED  SCHEDULED  DECODING  PREEMPTED  QUEUED  SCHEDULED  DECODING  FINISHED
    segments: |--queued-------|-prefilling-|-decoding-|--preempted-----|-prefilling-|-decoding-|

Invariants:

- Segments are contiguous and in time order; only the last one may be open (``end``
  None), and it is closed by FINISHED.
- ``feed`` may be called again with the same, grown list: it reads only the events it
  has not seen, so polling a long-running request costs what it added since.
- Times are the events' ``time.monotonic()`` stamps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.core.records import FinishReason, RequestEvent, RequestEventType

_E = RequestEventType
QUEUED, PREFILLING, DECODING, PREEMPTED = "queued", "prefilling", "decoding", "preempted"
_STATE_OF_EVENT = {_E.ARRIVED: QUEUED, _E.SCHEDULED: PREFILLING, _E.PREFILLING: PREFILLING,
                   _E.DECODING: DECODING, _E.PREEMPTED: PREEMPTED}
_STATUS_OF_FINISH = {FinishReason.STOP: "finished", FinishReason.LENGTH: "finished",
                     FinishReason.ABORT: "aborted", FinishReason.ERROR: "error"}


@dataclass(slots=True)
class Segment:
    state: str  # queued | prefilling | decoding | preempted
    start: float
    end: float | None = None


class Timeline:
    """The phases of one request so far, built incrementally from its events."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.arrival: float | None = None
        self.first_emitted: float | None = None  # first chunk with a token handed over
        self.end: float | None = None
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self._num_seen = 0

    def feed(self, events: Sequence[RequestEvent]) -> None:
        """Read the events appended since the last call."""
        for event in events[self._num_seen:]:
            self._read(event)
        self._num_seen = len(events)

    def _read(self, event: RequestEvent) -> None:
        kind = event.type
        if kind is _E.ARRIVED:
            self.arrival = event.ts
        elif kind is _E.EMITTED and event.num_tokens and self.first_emitted is None:
            self.first_emitted = event.ts
        elif kind is _E.PREEMPTED:
            self.num_preemptions += 1
        elif kind is _E.FINISHED:
            self.end, self.finish_reason = event.ts, event.finish_reason
            if self.segments and self.segments[-1].end is None:
                self.segments[-1].end = event.ts
            return
        state = _STATE_OF_EVENT.get(kind)
        if state is not None and self.end is None:
            self._enter(state, event.ts)

    @property
    def time_to_first_token(self) -> float | None:
        """First chunk with a token handed over - arrived (as in ``RequestStats``)."""
        if self.first_emitted is None or self.arrival is None:
            return None
        return self.first_emitted - self.arrival

    def _enter(self, state: str, ts: float) -> None:
        if self.segments:
            last = self.segments[-1]
            if last.state == state:
                return
            last.end = ts
        self.segments.append(Segment(state, ts))

    def status(self, finish_reason: FinishReason | None = None) -> str:
        """queued, prefilling, decoding or preempted while in flight; then finished (stop
        or length), aborted or error. ``finish_reason`` overrides the core's (a stop string
        ends a request as ``stop`` although the core saw an abort)."""
        reason = finish_reason or self.finish_reason
        if self.end is not None and reason is not None:
            return _STATUS_OF_FINISH[reason]
        return self.segments[-1].state if self.segments else QUEUED
