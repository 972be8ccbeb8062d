"""The server's caps on what one request may ask for.

Each cap is a ``tokenmill serve`` option (``--max-n`` -> ``max_n``). Exceeding one is a
400 naming the field (a 413 for the body size), raised before the request is tokenised
or reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_request_body_bytes: int = 8 << 20
    max_n: int = 128
    max_prompts_per_request: int = 256
    max_logprobs: int = 20
    max_stop_strings: int = 16  # also the most stop_token_ids
    max_stop_string_length: int = 256  # characters
    max_request_id_length: int = 256  # characters of an x-request-id header

    def __post_init__(self) -> None:
        for field in fields(self):
            name, value = field.name, getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}",
                                            name)

    def check_num_prompts(self, num_prompts: int) -> None:
        _cap(num_prompts, self.max_prompts_per_request, "prompts per request", "prompt")

    def check_params(self, params: SamplingParams, logprobs_param: str = "logprobs") -> None:
        _cap(params.n, self.max_n, "n", "n")
        if params.logprobs is not None:
            _cap(params.logprobs, self.max_logprobs, logprobs_param, logprobs_param)
        _cap(len(params.stop), self.max_stop_strings, "stop strings", "stop")
        _cap(len(params.stop_token_ids), self.max_stop_strings, "stop_token_ids",
             "stop_token_ids")
        for stop in params.stop:
            _cap(len(stop), self.max_stop_string_length, "characters in a stop string", "stop")

    def check_request_id(self, request_id: str) -> None:
        _cap(len(request_id), self.max_request_id_length, "characters in x-request-id",
             "x-request-id")


def _cap(value: int, limit: int, what: str, param: str) -> None:
    if value > limit:
        raise InvalidParameterError(f"at most {limit} {what} allowed; got {value}", param)
