"""Validated settings of one benchmark run.

``BenchConfig`` is what both the CLI and an API caller build; its ``__post_init__``
checks every field and fills the two defaults that depend on each other:

- load: ``concurrency`` or ``request_rate`` (not both); neither means concurrency 1;
- bound: ``num_requests`` and/or ``duration`` (whichever is reached first ends the
  run); neither means 100 requests.

Bad values raise ``BenchConfigError`` (a ``ValueError`` naming the field in ``.param``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

ENDPOINTS = ("completions", "chat")
SLO_KEYS = ("ttft", "tpot", "e2el")
DEFAULT_NUM_REQUESTS = 100


class BenchConfigError(ValueError):
    """A setting is invalid; ``param`` is the ``BenchConfig`` field it concerns."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param
        self.message = message


class BenchSetupError(RuntimeError):
    """The run cannot start: server unreachable, dataset unreadable, warm-up failed."""


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None  # None: the first model listed by GET /v1/models
    api_key: str | None = None
    endpoint: str = "completions"  # "completions" or "chat"
    concurrency: int | None = None
    request_rate: float | None = None  # requests/s; math.inf sends all at once
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 = Poisson
    num_requests: int | None = None
    duration: float | None = None  # seconds
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    dataset: str | None = None  # JSONL with "prompt" and optional "max_tokens"/"output_len"
    ignore_eos: bool = False
    temperature: float | None = None  # None: the server's default
    logprobs: int | None = None  # top log-probabilities asked for per output token
    seed: int = 0
    tokenizer: str | None = None  # local Hugging Face tokenizer folder
    goodput: dict[str, float] = field(default_factory=dict)  # SLO key -> milliseconds
    timeout: float = 600.0  # seconds to wait for a connection or for the next chunk
    progress: bool = False  # show a progress bar on stderr

    def __post_init__(self) -> None:
        self.base_url = _check_url(self.base_url)
        if self.endpoint not in ENDPOINTS:
            raise BenchConfigError("endpoint", f"must be one of {ENDPOINTS}, got {self.endpoint!r}")
        self._check_load()
        _positive_int("input_len", self.input_len)
        _positive_int("output_len", self.output_len)
        if not 0.0 <= self.range_ratio < 1.0:
            raise BenchConfigError("range_ratio", f"must be in [0, 1), got {self.range_ratio}")
        if self.dataset is not None and not os.path.isfile(self.dataset):
            raise BenchConfigError("dataset", f"is not a readable file: {self.dataset}")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise BenchConfigError("tokenizer", f"is not a tokenizer folder: {self.tokenizer}")
        for key, value in self.goodput.items():
            if key not in SLO_KEYS:
                raise BenchConfigError("goodput", f"keys are {SLO_KEYS}, got {key!r}")
            _positive_float("goodput", value)
        _positive_float("timeout", self.timeout)

    def _check_load(self) -> None:
        if self.concurrency is not None and self.request_rate is not None:
            raise BenchConfigError("concurrency", "and request_rate are exclusive: give one")
        if self.request_rate is None:
            self.concurrency = 1 if self.concurrency is None else self.concurrency
            _positive_int("concurrency", self.concurrency)
        else:
            _positive_float("request_rate", self.request_rate, allow_inf=True)
        _positive_float("burstiness", self.burstiness)
        if self.num_requests is not None:
            _positive_int("num_requests", self.num_requests)
        if self.duration is not None:
            _positive_float("duration", self.duration)
        elif self.num_requests is None:
            self.num_requests = DEFAULT_NUM_REQUESTS
        if self.request_rate == math.inf and self.num_requests is None:
            raise BenchConfigError("request_rate", "inf needs num_requests (a duration alone "
                                   "would send without end)")

    def describe_load(self) -> str:
        load = (f"concurrency {self.concurrency}" if self.concurrency is not None
                else f"request rate {self.request_rate}/s, burstiness {self.burstiness}")
        bounds = []
        if self.num_requests is not None:
            bounds.append(f"{self.num_requests} requests")
        if self.duration is not None:
            bounds.append(f"{self.duration:g} s")
        return f"{load}; bounded by {' or '.join(bounds)}"


def _check_url(url: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise BenchConfigError("base_url", f"must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    # NOTE: accept both the server root and its /v1 prefix; /tokenize lives at the root.
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _positive_int(param: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BenchConfigError(param, f"must be a positive integer, got {value!r}")


def _positive_float(param: str, value: object, allow_inf: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if not ok or math.isnan(value) or (value == math.inf and not allow_inf):
        raise BenchConfigError(param, f"must be a positive number, got {value!r}")
