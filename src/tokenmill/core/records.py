"""Plain records that cross from the engine core and the frontend into the metrics layer.

Standard library only: these are built from primitive values (monotonic timestamps,
counts) and never hold engine objects, so they pickle across a process boundary.

Lifecycle of one request (one choice of an ``n``-way request), as events::

    frontend: ARRIVED -> INPUT_PROCESSED ----------------------> EMITTED* -> FINISHED_EMITTED
    core:                 QUEUED -> SCHEDULED -> PREFILLING -> NEW_TOKENS -> DECODING
                                       ^          NEW_TOKENS* (PREEMPTED -> QUEUED -> SCHEDULED
                                       |           -> PREFILLING -> ... again) -> FINISHED

Every ``ts`` is ``time.monotonic()`` in the process that stamped it.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, fields


class RequestEventType(enum.Enum):
    # frontend
    ARRIVED = "arrived"  # the request was received
    INPUT_PROCESSED = "input_processed"  # tokenised and validated
    EMITTED = "emitted"  # a chunk carrying ``num_tokens`` tokens was handed to the client
    FINISHED_EMITTED = "finished_emitted"  # the last chunk/response was handed over
    # engine core
    QUEUED = "queued"  # entered the waiting queue (on arrival and after a preemption)
    SCHEDULED = "scheduled"  # entered the running batch
    PREFILLING = "prefilling"  # started computing tokens that precede its next output
    DECODING = "decoding"  # its prefill is complete: each step now yields tokens
    NEW_TOKENS = "new_tokens"  # ``num_tokens`` tokens committed in one step
    PREEMPTED = "preempted"  # evicted from the batch; its KV blocks were freed
    FINISHED = "finished"  # the core finished it, with ``finish_reason``


def pickled_by_fields(cls: type) -> type:
    """Pickle a dataclass's instances as its class and its field values, in order (it must
    have two fields or more, each an ``__init__`` argument). A dataclass with slots
    otherwise pickles through generated ``__getstate__``/``__setstate__`` that look its
    fields up on every call: several times slower, and these records cross the engine's
    pipe every step, one or more for each request in the batch."""
    values = operator.attrgetter(*(f.name for f in fields(cls)))

    def __reduce__(self):  # noqa: N807 - the pickle protocol's name
        return cls, values(self)

    cls.__reduce__ = __reduce__
    return cls


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class RequestEvent:
    type: RequestEventType
    ts: float
    num_tokens: int = 0  # NEW_TOKENS and EMITTED: how many tokens
    finish_reason: FinishReason | None = None  # FINISHED only


@pickled_by_fields
@dataclass(slots=True)
class RequestCounters:
    """One request's lifetime counters: the scheduler adds to them as the request runs,
    and a copy goes out with its final output (``EngineCoreOutput.counters``)."""

    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # tokens computed again after preemptions
    model_forward_time: float = 0.0  # seconds of the steps it took part in
    num_draft_tokens: int = 0  # speculative drafts verified
    num_accepted_tokens: int = 0  # of which accepted


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler's state after one step (gauges); ``SchedulerStats()`` is an idle one."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # used blocks / total blocks, 0..1
    kv_cache_tokens_used: int = 0  # used blocks * block size
    num_tokens_waiting: int = 0  # tokens waiting requests must compute, less expected cache hits
    num_tokens_waiting_raw: int = 0  # the same without the cache deduction


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class IterationStats:
    """What one engine step did (counters)."""

    num_scheduled_tokens: int  # tokens computed by the forward pass (prompt chunks + decodes)
    num_prompt_tokens: int  # prompt lengths of requests that committed their first token
    num_cached_prompt_tokens: int  # of which served by the prefix cache
    num_generation_tokens: int  # tokens committed to requests' outputs
    batch_size: int  # requests in the step
    step_time: float  # seconds: schedule + forward + update
    forward_time: float  # seconds in the model's forward pass and sampler
    num_preemptions: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache this step
    prefix_cache_hits: int  # of which found cached
    num_drafts: int = 0  # requests that verified speculative drafts
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of which accepted
    # seconds each grammar compilation (structured output) took, of those done since the
    # previous step that ran
    grammar_compile_times: tuple[float, ...] = ()
