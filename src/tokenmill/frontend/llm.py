"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``, as in vLLM.

Drives the engine through its in-process client (``engine.inproc``): the step loop the
server's engine process runs turns on the calling thread. Every prompt is submitted at
once, so they are batched continuously like server traffic. A failed step raises
``RuntimeError``, its unfinished requests aborted.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import fields

from tokenmill.config import EngineConfig
from tokenmill.core.records import FinishReason
from tokenmill.engine.inproc import InprocClient
from tokenmill.engine.messages import StepReport
from tokenmill.errors import InvalidParameterError
from tokenmill.frontend.outputs import ChoiceDelta, CompletionOutput, RequestOutput
from tokenmill.frontend.processor import InputProcessor
from tokenmill.frontend.request_state import ChoiceState, open_choices
from tokenmill.model_hub import local_model
from tokenmill.sampling_params import PoolingParams, SamplingParams
from tokenmill.tokenizer.tokenizer import Tokenizer, load_tokenizer

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **options) -> None:
        known = {f.name for f in fields(EngineConfig)} - {"model"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidParameterError(
                f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}",
                unknown[0])
        model = local_model(model)  # a Hub repository's name: fetched into the cache
        self.client = InprocClient(EngineConfig(model=model, **options))
        self.tokenizer: Tokenizer = load_tokenizer(model)
        self.processor = InputProcessor(self.tokenizer, self.client.info)
        self.client.set_vocabulary(self.processor.vocabulary())
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in prompt order, with per-choice stats."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params, len(prompt_list))
        results: dict[str, RequestOutput] = {}
        choices: dict[str, tuple[RequestOutput, ChoiceState]] = {}
        for prompt, params in zip(prompt_list, params_list, strict=True):
            output, states = self._submit(prompt, params)
            results[output.request_id] = output
            for state in states:
                choices[state.req_id] = (output, state)
        for output, delta in self._run(choices):
            output.outputs[delta.index].add(delta)
        return list(results.values())

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             ) -> RequestOutput:
        prompt_ids = self.tokenizer.apply_chat_template(messages)
        return self.generate([prompt_ids], sampling_params)[0]

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling: PoolingParams | None = None) -> list[list[float]]:
        """One vector per prompt, in prompt order: its hidden states after the final norm,
        pooled (last token and L2-normalised by default), computed by the same engine."""
        pooling = pooling or PoolingParams()
        choices: dict[str, tuple[RequestOutput, ChoiceState]] = {}
        vectors: dict[str, list[float]] = {}
        for prompt in _as_prompt_list(prompts):
            core_request = self.processor.make_pooling_request(
                f"offline-{next(self._ids)}", self.processor.tokenize(prompt), pooling)
            state = open_choices([core_request], self.tokenizer, time.monotonic())[0]
            self.client.add_request(core_request)
            choices[state.req_id] = (RequestOutput(state.req_id, None, [], []), state)
        for output, delta in self._run(choices):
            if delta.embedding is not None:
                vectors[output.request_id] = list(delta.embedding)
        return [vectors[req_id] for req_id in choices]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               ) -> Iterator[ChoiceDelta]:
        """The deltas of one request as the engine produces them."""
        output, states = self._submit(prompt, sampling_params or SamplingParams())
        for _, delta in self._run({s.req_id: (output, s) for s in states}):
            yield delta

    def _submit(self, prompt: Prompt, params: SamplingParams
                ) -> tuple[RequestOutput, list[ChoiceState]]:
        arrival = time.monotonic()
        prompt_ids = self.processor.tokenize(prompt)
        request_id = f"offline-{next(self._ids)}"
        core_requests = self.processor.make_core_requests(request_id, prompt_ids, params)
        states = open_choices(core_requests, self.tokenizer, arrival)
        for r in core_requests:
            self.client.add_request(r)
        text = prompt if isinstance(prompt, str) else None
        output = RequestOutput(request_id, text, prompt_ids,
                               [CompletionOutput(i) for i in range(params.n)])
        return output, states

    def _run(self, choices: dict[str, tuple[RequestOutput, ChoiceState]]):
        unfinished = set(choices)  # in the core: each gets a final output from a later step
        try:
            while unfinished:
                report = self._next_step()
                outputs = [o for o in report.outputs.outputs if o.req_id in unfinished]
                unfinished -= {o.req_id for o in outputs if o.finished}
                for out in outputs:
                    request_output, state = choices[out.req_id]
                    request_output.num_cached_tokens = out.num_cached_tokens
                    for delta in state.process(out):
                        yield request_output, state.mark_emitted(delta)
                if report.failed:
                    raise RuntimeError(report.error)
        finally:
            if unfinished:  # the caller stopped early, or a step failed: free what is left
                self.client.abort_requests(sorted(unfinished), FinishReason.ABORT)
                while unfinished:
                    unfinished -= {o.req_id for o in self._next_step().outputs.outputs
                                   if o.finished}

    def _next_step(self) -> StepReport:
        """The next step's report (the queue states between steps are the server's)."""
        while True:
            report = self.client.get_output()
            assert report is not None, "the offline engine is never shut down"
            if isinstance(report, StepReport):
                return report


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]
    return items


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None,
               count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidParameterError("one SamplingParams per prompt, or a single one",
                                    "sampling_params")
    return params
