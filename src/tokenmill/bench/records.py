"""Plain records of a benchmark: what a stream delivered, and what it counts as.

A request goes through two stages::

    stream.py  -> RawResponse   timestamps, text and usage exactly as received
    counting.py -> RequestRecord tokens per chunk, TTFT, ITL, TPOT, status

Keeping the raw stage separate means counting (which may run a tokenizer) happens
after the run, never on the event loop that is timing other requests, and is a pure
function that tests can feed fixed events.

Times: ``*_ts`` are ``time.perf_counter()`` values; every ``*_s`` field is seconds,
either a duration or an offset from the start named in its comment.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(str, enum.Enum):
    OK = "ok"  # the stream ended normally
    FAILED = "failed"  # HTTP error, error event, dropped connection or malformed stream
    CUT_OFF = "cut_off"  # still running when a duration run ended; cancelled


class CountingMethod(str, enum.Enum):
    CONTINUOUS_USAGE = "continuous_usage"  # exact: deltas of cumulative per-chunk usage
    FINAL_USAGE = "final_usage"  # exact total from the last usage; per-chunk split estimated
    TOKENIZER = "tokenizer"  # local tokenizer over the received text
    CHUNKS = "chunks"  # one token per chunk carrying text


@dataclass(slots=True)
class StreamEvent:
    """One received chunk that carried a choice."""

    ts_s: float  # seconds since the request was sent
    choice: int  # the choice's index
    text: str  # text (completions) or delta content (chat); "" if none
    completion_tokens: int | None  # cumulative usage for this choice; None if the chunk had none


@dataclass(slots=True)
class RawResponse:
    """Everything a stream delivered, before any token counting."""

    index: int  # request number in the run, from 0
    max_tokens: int  # requested output length
    prompt_tokens_local: int  # prompt length measured by the client (see prompt_length_method)
    start_s: float = 0.0  # when it was sent, seconds since the run started
    end_s: float | None = None  # seconds since the request was sent; None until it ends
    events: list[StreamEvent] = field(default_factory=list)
    usage_prompt_tokens: int | None = None  # prompt_tokens from any usage the server sent
    final_completion_tokens: int | None = None  # from the choices-less usage chunk or error event
    finished: bool = False  # [DONE] arrived, or a finish_reason with a cleanly closed stream
    http_status: int | None = None  # the response's status code, once headers arrived
    status: Status | None = None  # set when the request ends
    error: str | None = None


@dataclass(slots=True)
class RequestRecord:
    """One request's counted result; the unit of the JSON ``requests`` list."""

    index: int
    status: Status
    error: str | None
    start_s: float  # seconds since the run started
    e2e_s: float  # sent -> stream ended (or cut off / failed)
    prompt_tokens: int  # the server's usage if it sent any, else the client's measure
    max_tokens: int
    output_tokens: int
    counting_method: CountingMethod
    ttft_s: float | None  # sent -> first chunk carrying a token; None without tokens
    tpot_s: float | None  # (last token time - first token time) / (tokens - 1); None if < 2
    itl_s: list[float]  # per token: a k-token chunk after a gap g gives k samples g/k
    chunks: list[tuple[float, int]]  # (seconds since sent, tokens) per chunk carrying tokens

    def to_json(self) -> dict:
        return {
            "index": self.index, "status": self.status.value, "error": self.error,
            "start_s": self.start_s, "e2e_s": self.e2e_s,
            "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens, "counting_method": self.counting_method.value,
            "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "itl_s": self.itl_s,
            "chunks": [list(c) for c in self.chunks],
        }
