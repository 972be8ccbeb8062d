"""The one step loop (``engine.loop``) over a torch-free core: its reports, its sleep and
wake-ups (a grammar that finishes compiling wakes it; nothing else is waited for), and
stop strings matched in the core, on the token that completes one."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fake_executor import make_core, make_request

from tokenmill.core.records import FinishReason
from tokenmill.engine.loop import Outbox, StepLoop
from tokenmill.engine.messages import Abort, QueueState, StepReport
from tokenmill.sampling_params import StructuredOutput
from tokenmill.structured.compiler import Vocabulary
from tokenmill.tokenizer.tokenizer import Tokenizer, load_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog, and then it sleeps."
CHOICE = StructuredOutput("choice", json.dumps(["yes", "no"]))
LONG_COMPILE_TIMEOUT = 60.0  # a lost wake-up would make a request wait this long


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return load_tokenizer(None)


def vocabulary(tok: Tokenizer) -> Vocabulary:
    return Vocabulary(tok.backend.to_str(), 49152, tuple(sorted(tok.eos_token_ids)))


def scripted(prompt: list[int], script: list[int]):
    """A fake model that writes ``script`` after ``prompt``, then repeats its last token."""
    def next_token(sequence) -> int:
        return script[min(len(sequence) - len(prompt), len(script) - 1)]
    return next_token


def loop_over(**make) -> tuple[StepLoop, list]:
    """A step loop over a fake core (``make_core``'s arguments), and the reports it sends."""
    reports: list = []
    outbox = Outbox(reports.append)
    return StepLoop(make_core(on_scheduled=outbox.queue_state, **make), outbox), reports


def turn_until_finished(loop: StepLoop, reports: list, req_id: str, timeout: float = 30.0):
    """Turn the loop until ``req_id`` finishes; its final output and the tokens it got."""
    deadline = time.monotonic() + timeout
    tokens: list[int] = []
    seen = 0
    while time.monotonic() < deadline:
        assert loop.turn()
        for report in reports[seen:]:
            if isinstance(report, StepReport):
                for out in report.outputs.outputs:
                    if out.req_id == req_id:
                        tokens += out.new_token_ids
                        if out.finished:
                            return out, tokens
        seen = len(reports)
    raise AssertionError(f"{req_id} did not finish in {timeout} s")


def test_each_step_reports_its_queue_then_its_outputs_then_goes_idle() -> None:
    loop, reports = loop_over()
    first, second = make_request([1, 2, 3], max_tokens=2), make_request([4, 5], max_tokens=2)
    loop.put(first)
    loop.put(second)
    out, _ = turn_until_finished(loop, reports, first.req_id)
    assert out.finish_reason is FinishReason.LENGTH
    assert isinstance(reports[0], QueueState) and isinstance(reports[1], StepReport)
    assert (reports[0].taken_requests, reports[0].taken_tokens) == (2, 5)
    assert reports[0].stats.num_running == 2
    assert loop.turn()  # nothing left: the idle report, gauges at zero
    idle = reports[-1]
    assert isinstance(idle, StepReport) and idle.failed is None
    assert idle.outputs.scheduler_stats.num_running == 0
    loop.put(None)
    assert not loop.turn()


def test_an_abort_takes_effect_before_the_next_step() -> None:
    loop, reports = loop_over()
    request = make_request([1, 2, 3], max_tokens=50)
    loop.put(request)
    assert loop.turn()
    loop.put(Abort([request.req_id], FinishReason.ABORT))
    out, tokens = turn_until_finished(loop, reports, request.req_id)
    assert out.finish_reason is FinishReason.ABORT and len(tokens) == 1
    loop.core.check_integrity()


def test_a_sleeping_loop_wakes_for_a_message_from_another_thread() -> None:
    loop, reports = loop_over()
    thread = threading.Thread(target=loop.run)
    thread.start()
    time.sleep(0.1)  # asleep: nothing to do
    request = make_request([1, 2, 3], max_tokens=3)
    loop.put(request)
    deadline = time.monotonic() + 10
    while not any(o.finished for r in list(reports) if isinstance(r, StepReport)
                  for o in r.outputs.outputs):
        assert time.monotonic() < deadline, "the loop slept through a message"
        time.sleep(0.01)
    loop.put(None)
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_finished_compilation_wakes_the_core(smol) -> None:
    """The grammar compiler's hook is the core's wake-up: ``wait`` ends when the
    compilation does, not at the compile deadline."""
    core = make_core(structured_output_compile_timeout=LONG_COMPILE_TIMEOUT)
    core.set_vocabulary(vocabulary(smol))
    core.add_request(make_request([1, 2, 3], max_tokens=4, structured_output=CHOICE))
    assert not core.can_step()  # compiling
    start = time.monotonic()
    assert core.wait(timeout=LONG_COMPILE_TIMEOUT), "no wake-up when the compilation ended"
    assert time.monotonic() - start < LONG_COMPILE_TIMEOUT / 2
    assert core.can_step()


def test_a_constrained_request_through_the_loop_completes_promptly(smol) -> None:
    yes = smol.encode("yes")
    prompt = [1, 2, 3]
    loop, reports = loop_over(next_token=scripted(prompt, yes),
                              structured_output_compile_timeout=LONG_COMPILE_TIMEOUT)
    loop.put(vocabulary(smol))
    request = make_request(prompt, max_tokens=8, structured_output=CHOICE)
    start = time.monotonic()
    loop.put(request)
    out, tokens = turn_until_finished(loop, reports, request.req_id,
                                      timeout=LONG_COMPILE_TIMEOUT / 2)
    assert out.finish_reason is FinishReason.STOP and tokens == yes
    assert time.monotonic() - start < LONG_COMPILE_TIMEOUT / 2


def test_a_compilation_past_its_deadline_fails_its_request_at_the_deadline(smol) -> None:
    loop, reports = loop_over(structured_output_compile_timeout=0.2)
    loop.put(vocabulary(smol))
    compile_now = loop.core.grammars._compile

    def slow_compile(constraint):
        time.sleep(2.0)
        return compile_now(constraint)

    loop.core.grammars._compile = slow_compile
    request = make_request([1, 2, 3], max_tokens=8, structured_output=CHOICE)
    start = time.monotonic()
    loop.put(request)
    out, tokens = turn_until_finished(loop, reports, request.req_id)
    assert out.finish_reason is FinishReason.ERROR and "longer than" in out.error
    assert tokens == [] and time.monotonic() - start < 1.5


@pytest.mark.parametrize("tokens_per_step", [1, 3])
@pytest.mark.parametrize("include", [False, True])
def test_the_core_stops_on_the_token_that_completes_a_stop_string(
        smol, tokens_per_step, include) -> None:
    """One token a step, or several (as accepted speculative drafts commit them): the
    request's last token is the one whose text completes the stop string."""
    script = smol.encode(TEXT)
    stop = "fox ju"
    prompt = [5, 6, 7]
    loop, reports = loop_over(tokens_per_step=tokens_per_step, next_token=scripted(prompt, script))
    loop.put(vocabulary(smol))
    request = make_request(prompt, max_tokens=40, stop=[stop],
                           include_stop_str_in_output=include)
    loop.put(request)
    out, tokens = turn_until_finished(loop, reports, request.req_id)
    completes = next(k for k in range(1, len(script)) if stop in smol.decode(script[:k]))
    assert out.finish_reason is FinishReason.STOP
    assert tokens == script[:completes]
    assert sum(r.outputs.iteration_stats.num_generation_tokens for r in reports
               if isinstance(r, StepReport) and r.outputs.iteration_stats) == completes
    loop.core.check_integrity()


def test_stop_strings_without_the_tokenizer_fail_the_request() -> None:
    loop, reports = loop_over()
    request = make_request([1, 2, 3], max_tokens=8, stop=["x"])
    loop.put(request)
    out, tokens = turn_until_finished(loop, reports, request.req_id)
    assert out.finish_reason is FinishReason.ERROR and "tokenizer" in out.error
    assert tokens == []
