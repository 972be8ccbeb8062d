"""The records that cross the engine's pipe pickle as their field values
(``records.pickled_by_fields``) and come back equal, nested records and all."""

from __future__ import annotations

import pickle

from tokenmill.core.records import (
    FinishReason,
    IterationStats,
    RequestCounters,
    RequestEvent,
    RequestEventType,
    SchedulerStats,
)
from tokenmill.core.types import EngineCoreOutput, EngineCoreOutputs, TokenLogprob
from tokenmill.engine.messages import QueueState, StepReport


def step_report() -> StepReport:
    logprob = TokenLogprob(token_id=7, logprob=-0.25, rank=1, top=((7, -0.25), (9, -1.5)))
    outputs = (
        EngineCoreOutput(req_id="a", new_token_ids=(7,), new_logprobs=(logprob,),
                         events=(RequestEvent(RequestEventType.NEW_TOKENS, 12.5, 1),)),
        EngineCoreOutput(req_id="b", new_token_ids=(3, 4), new_logprobs=None,
                         events=(RequestEvent(RequestEventType.FINISHED, 13.0, 0,
                                              FinishReason.LENGTH),),
                         finish_reason=FinishReason.LENGTH, num_cached_tokens=16,
                         counters=RequestCounters(num_preemptions=1, model_forward_time=0.5)),
    )
    iteration = IterationStats(num_scheduled_tokens=3, num_prompt_tokens=0,
                               num_cached_prompt_tokens=0, num_generation_tokens=3,
                               batch_size=2, step_time=0.01, forward_time=0.008,
                               num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
                               grammar_compile_times=(0.2,))
    stats = SchedulerStats(num_running=2, kv_cache_usage=0.25, kv_cache_tokens_used=64)
    return StepReport(EngineCoreOutputs(outputs, stats, iteration), error=None, failed=False)


def test_a_step_report_round_trips_through_pickle():
    report = step_report()
    again = pickle.loads(pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL))
    assert again == report
    assert type(again.outputs.outputs[1].counters) is RequestCounters
    assert again.outputs.outputs[1].finish_reason is FinishReason.LENGTH


def test_a_queue_state_round_trips_through_pickle():
    state = QueueState(taken_requests=2, taken_tokens=40, stats=SchedulerStats(num_waiting=2))
    assert pickle.loads(pickle.dumps(state)) == state

