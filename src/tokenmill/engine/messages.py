"""The records that cross the pipe between the HTTP process and the engine process.

    HTTP process                                           engine process
    ProcessClient --EngineCoreRequest / Abort / None---->  StepLoop
                  --Vocabulary (once, at start) -------->
                  <------- QueueState, StepReport -------
                  <------- EngineInfo (once, at start) --

(``Vocabulary``, the tokenizer that structured outputs compile for, is
``structured.compiler``'s.)

Standard library and the core's plain types only: the HTTP side imports this module
and must stay free of torch, models and kernels.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tokenmill.core.records import FinishReason, SchedulerStats, pickled_by_fields
from tokenmill.core.types import EngineCoreOutputs


@dataclass(frozen=True, slots=True)
class Abort:
    req_ids: list[str]
    reason: FinishReason


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class StepReport:
    """One engine step's outputs, or the idle publication after the last one."""

    outputs: EngineCoreOutputs
    error: str | None  # why the requests that ended with finish reason "error" did
    failed: bool | None  # the step failed; None: no step ran (the idle publication)


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class QueueState:
    """The scheduler's gauges once a step has scheduled (sent before its forward pass)."""

    taken_requests: int  # requests the core took from the inbox since the last QueueState
    taken_tokens: int  # their prompt tokens
    stats: SchedulerStats


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the HTTP side needs to know about the engine it did not build itself."""

    model_name: str
    max_model_len: int
    vocab_size: int  # the model's output rows (the tokenizer may name fewer ids)
    kv_cache_tokens: int  # KV blocks * block size
    scheduling_policy: str = "fcfs"  # EngineConfig.scheduling_policy
    pid: int = field(default_factory=os.getpid)  # the engine's process: the one building this
