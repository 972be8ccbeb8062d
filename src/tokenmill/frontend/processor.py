"""Input processing: tokenise and validate a request, then split it into one engine
request per choice.

Invariant: every EngineCoreRequest it returns fits the model (prompt + max_tokens <=
max_model_len, every token id inside the vocabulary), so the core never sees bad input.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.core.request import EngineCoreRequest
from tokenmill.engine.messages import EngineInfo
from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import PoolingParams, SamplingParams
from tokenmill.structured.compiler import Vocabulary
from tokenmill.tokenizer.tokenizer import Tokenizer


class InputProcessor:
    """Checks requests against the engine ``info`` describes, with the model's tokenizer.

    Token ids are accepted below ``vocab_size``: the fewer of the model's output rows and
    the tokenizer's ids."""

    def __init__(self, tokenizer: Tokenizer, info: EngineInfo) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = min(info.vocab_size, tokenizer.vocab_size)
        self.model_vocab_size = info.vocab_size
        self.scheduling_policy = info.scheduling_policy

    def vocabulary(self) -> Vocabulary:
        """What the engine's grammar compiler needs of the tokenizer (structured outputs)."""
        return Vocabulary(self.tokenizer.backend.to_str(), self.model_vocab_size,
                          tuple(sorted(self.tokenizer.eos_token_ids)))

    def tokenize(self, prompt: str | Sequence[int], param: str = "prompt") -> list[int]:
        """Token ids of a text prompt, or a token-id prompt checked against the vocabulary;
        an empty one is an error naming ``param``."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameterError(f"{param} must not be empty", param)
            return self.tokenizer.encode(prompt)
        ids = self.check_token_ids(prompt, param)
        if not ids:
            raise InvalidParameterError(f"{param} must not be empty", param)
        return ids

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> list[int]:
        """``token_ids`` as a list, once each is known to be inside the vocabulary."""
        ids = list(token_ids)
        for token_id in ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not (
                    0 <= token_id < self.vocab_size):
                raise InvalidParameterError(
                    f"token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})",
                    param)
        return ids

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidParameterError(
                f"the prompt has {num_prompt_tokens} tokens; this model's maximum context "
                f"length is {self.max_model_len} tokens", "prompt")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise InvalidParameterError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"this model's maximum context length of {self.max_model_len} tokens",
                "max_tokens")
        return params.max_tokens

    def check_priority(self, priority: int) -> int:
        """``priority`` once the engine's scheduling policy honours it (any integer with
        "priority"; only 0 with "fcfs", as vLLM answers)."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidParameterError(
                "priority is honoured only when the server schedules by priority "
                "(--scheduling-policy priority); this one schedules first come, first "
                "served, where it must be 0", "priority")
        return priority

    def make_core_requests(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams, priority: int = 0) -> list[EngineCoreRequest]:
        self.check_priority(priority)
        max_tokens = self.resolve_max_tokens(len(prompt_token_ids), params)
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(params.logit_bias or (), "logit_bias")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidParameterError(
                f"logprobs must be at most the vocabulary size ({self.vocab_size})", "logprobs")
        prompt = tuple(prompt_token_ids)
        eos = self.tokenizer.eos_token_ids
        group = request_id if params.n > 1 else None
        children = []
        for index in range(params.n):
            child = params.for_child(index)
            child.max_tokens = max_tokens
            children.append(EngineCoreRequest(
                req_id=child_request_id(request_id, index, params.n),
                prompt_token_ids=prompt,
                sampling_params=child,
                eos_token_ids=eos,
                group_id=group,
                priority=priority,
            ))
        return children

    def make_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                             pooling: PoolingParams) -> EngineCoreRequest:
        """An embedding request: its prompt within the context, nothing to generate."""
        if len(prompt_token_ids) > self.max_model_len:
            raise InvalidParameterError(
                f"the input has {len(prompt_token_ids)} tokens; this model's maximum context "
                f"length is {self.max_model_len} tokens", "input")
        return EngineCoreRequest(
            req_id=request_id, prompt_token_ids=tuple(prompt_token_ids),
            sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
            eos_token_ids=self.tokenizer.eos_token_ids, pooling=pooling)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}-{index}"
