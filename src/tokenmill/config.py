"""Engine and server settings: frozen records, validated once when they are built.

Every setting is a dataclass field whose ``metadata`` holds its help text (``option``),
and the CLI builds its flags from those fields alone (``tokenmill.options``): a field's
name in snake_case is its flag (``max_num_seqs`` -> ``--max-num-seqs``), so
``LLM(**options)``, ``tokenmill serve --...`` and ``EngineConfig(...)`` agree, and a new
setting needs one line here and nothing in the CLI.

- ``EngineConfig``: what the engine process builds and how it schedules;
- ``RequestLimits``: the server's caps on what one request may ask for;
- ``ServerConfig``: the HTTP side (address, API keys, limits, stats and page options).

All three pickle as they are (a Ray replica receives them so). Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from tokenmill.errors import InvalidParameterError
from tokenmill.quantization_names import QUANTIZATION_OPTIONS
from tokenmill.sampling_params import POOLING_KINDS, SamplingParams, StructuredOutput

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
KERNEL_CHOICES = ("auto", "native", "torch")
KV_CACHE_DTYPE_CHOICES = ("auto", "int8")
SCHEDULING_POLICIES = ("fcfs", "priority")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
               "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def option(default: Any = MISSING, help: str = "", *, choices: tuple[str, ...] | None = None,
           flag: str | None = None, parse: Any = None, cli: bool = True,
           default_factory: Any = MISSING) -> Any:
    """A dataclass field that is also a command-line option.

    ``help`` is the option's help text; ``choices`` its allowed values; ``flag`` its name
    when that is not the field's (``--api-key`` fills ``api_keys``); ``parse`` turns the
    flag's text into the field's value (``parse_size``); ``cli=False`` keeps it off the
    command line."""
    metadata = {"help": help, "choices": choices, "flag": flag, "parse": parse, "cli": cli}
    return field(default=default, default_factory=default_factory, metadata=metadata)


def parse_size(text: str | int, param: str = "kv_cache_memory") -> int:
    """Bytes from ``4GiB``, ``512M``, ``1073741824`` (binary units)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise InvalidParameterError(f"not a memory size: {text!r} (try 2GiB)", param)
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}", name)


def _one_of(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidParameterError(
            f"unknown {name} {value!r} (choose one of: {', '.join(choices)})", name)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = option(
        None, "HF folder, GGUF file, or Hub repository: org/repo, or org/repo:QUANT for one "
        "GGUF file of it (default: the embedded SmolLM2-135M-Instruct)")
    dtype: str = option("auto", "auto (bfloat16 where the CPU or GPU computes it natively, "
                        "else float32), float32, bfloat16 or float16", choices=DTYPE_CHOICES)
    quantization: str = option(
        "auto", "auto (gguf for a GGUF file holding quantized weights, where this host runs "
        "it; none otherwise); none; int8 or int4 (GGUF Q4_1's layout): quantized weights, "
        "activations in the dtype; w4a8, w8a8: int4 or int8 weights times activations "
        "quantized to int8 (CPU; w8a8 and bfloat16 w4a8 need AVX512-VNNI); gguf: a GGUF "
        "file's own blocks, exactly (docs/gguf.md: Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 times "
        "activations quantized to int8 where the CPU has AVX512-VNNI, else in the int8 and "
        "int4 kernels with activations in the dtype; Q2_K and float types in the dtype; "
        "CPU); gguf-llama-cpp: a GGUF file's values in float32 times activations rounded as "
        "llama.cpp's CPU backend rounds them (8 bits per block of 32 or 256 by weight "
        "type), to compare with it",
        choices=QUANTIZATION_OPTIONS)
    device: str = option("auto", "auto (CUDA when present), cpu or cuda[:N]")
    num_threads: int | None = option(
        None, "the engine's compute threads, fixed (default: one per CPU it may use, fewer "
        "while other programs take their share of those CPUs)")
    kernels: str = option(
        "auto", "auto (the native CPU kernels, compiled for this CPU on first use, where they "
        "build: linear layers, attention, norms, rotary, SiLU and sampling), native, or torch "
        "(PyTorch's own)", choices=KERNEL_CHOICES)
    max_model_len: int | None = option(
        None, "longest prompt + output in tokens (default: the model's, at most 8192)")
    block_size: int = option(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = option(None, "KV-cache blocks (overrides --kv-cache-memory)")
    kv_cache_memory: str | int = option("1GiB", "memory for the KV cache, e.g. 1GiB")
    kv_cache_dtype: str = option(
        "auto", "the KV cache's storage: auto (the model's dtype) or int8 (each token's keys "
        "and values 8 bits a value with one scale per head: about half of bfloat16's memory "
        "and reads, for a small loss of accuracy)", choices=KV_CACHE_DTYPE_CHOICES)
    max_num_seqs: int = option(64, "most requests in one step")
    max_num_batched_tokens: int = option(256, "token budget of one step")
    scheduling_policy: str = option(
        "fcfs", "fcfs (arrival order; a request's priority must be 0) or priority (a request's "
        "priority, lower first, then arrival: the waiting queue in that order, and the "
        "lowest-priority running request preempted first, also to make room for a waiting "
        "request that outranks it)", choices=SCHEDULING_POLICIES)
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a cached prompt prefix")
    enable_chunked_prefill: bool = option(
        True, "split long prompts over steps, beside the running decodes")
    seed: int = option(0, "seed of the default random generator")
    max_num_queued_requests: int | None = option(
        None, "answer 503 beyond this many waiting requests (default: no cap)")
    max_num_queued_tokens: int | None = option(
        None, "answer 503 beyond this many waiting prompt tokens (default: no cap)")
    speculative_ngram: int = option(
        0, "speculative decoding: draft up to K tokens per step by looking the last tokens up "
        "in the prompt and output (0: off)")
    ngram_min: int = option(2, "shortest run of last tokens a draft lookup may match")
    ngram_max: int = option(4, "longest run of last tokens a draft lookup tries first")
    speculative_disable_by_batch_size: int = option(
        4, "no drafts in a step while more than this many requests run")
    batch_invariant: bool = option(
        False, "compute every token the same whatever the schedule (batch mates, chunked "
        "prefill, prefix-cache hits, preemption; speculation never changes it): the native "
        "linear kernels even where oneDNN's AMX ones prefill faster, and the decode attention "
        "for prompts where the prefill attention is PyTorch's (CPU with the native kernels "
        "of the dtype)")
    structured_output_compile_timeout: float = option(
        10.0, "seconds a grammar (structured output, tool call) may take to compile in the "
        "engine, off its step; beyond that its request ends with an error")

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "ngram_min",
                     "ngram_max", "speculative_disable_by_batch_size"):
            _positive(name, getattr(self, name))
        for name in ("max_model_len", "num_threads", "num_kv_blocks",
                     "max_num_queued_requests", "max_num_queued_tokens"):
            _positive(name, getattr(self, name), allow_none=True)
        _one_of("dtype", self.dtype, DTYPE_CHOICES)
        _one_of("quantization", self.quantization, QUANTIZATION_OPTIONS)
        _one_of("kernels", self.kernels, KERNEL_CHOICES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES)
        _one_of("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if (not isinstance(self.speculative_ngram, int) or isinstance(self.speculative_ngram, bool)
                or self.speculative_ngram < 0):
            raise InvalidParameterError(
                f"speculative_ngram must be 0 (off) or a positive integer, got "
                f"{self.speculative_ngram!r}", "speculative_ngram")
        if self.ngram_min > self.ngram_max:
            raise InvalidParameterError(
                f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})",
                "ngram_min")
        if not self.structured_output_compile_timeout > 0:
            raise InvalidParameterError("structured_output_compile_timeout must be positive",
                                        "structured_output_compile_timeout")
        if self.kv_cache_memory_bytes < 1:
            raise InvalidParameterError("kv_cache_memory must be positive", "kv_cache_memory")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise InvalidParameterError(f"unknown device {self.device!r}: auto, cpu or cuda[:N]",
                                        "device")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_model_len > self.max_num_batched_tokens):
            raise InvalidParameterError(
                "without chunked prefill, max_num_batched_tokens must be at least max_model_len",
                "max_num_batched_tokens")

    @property
    def kv_cache_memory_bytes(self) -> int:
        return parse_size(self.kv_cache_memory)


def _parse_body_size(text: str) -> int:
    return parse_size(text, "max_request_body_size")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The server's caps on what one request may ask for. Exceeding one is a 400 naming the
    field (a 413 for the body size), raised before the request is tokenised or reaches the
    engine."""

    max_request_body_bytes: int = option(
        8 << 20, "largest request body, e.g. 8MiB (413 beyond it)",
        flag="max-request-body-size", parse=_parse_body_size)
    max_n: int = option(128, "most choices (n) per request")
    max_prompts_per_request: int = option(256, "most prompts in one completions request")
    max_logprobs: int = option(20, "most top logprobs per token (logprobs, top_logprobs)")
    max_stop_strings: int = option(16, "most stop strings, and most stop_token_ids, per request")
    max_stop_string_length: int = option(256, "most characters in one stop string")
    max_request_id_length: int = option(256, "most characters in an x-request-id header")
    max_structured_output_chars: int = option(
        65536, "most characters in a request's JSON schema, regex, grammar or choice list "
        "(for tool_choice required or a named function: the tools' parameters schemas)")

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive(f.name, getattr(self, f.name))

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

    def check_structured_output(self, constraint: StructuredOutput, param: str) -> None:
        _cap(len(constraint.spec), self.max_structured_output_chars,
             "characters in a structured output's schema, regex, grammar or choices", param)

    def check_request_id(self, request_id: str) -> None:
        _cap(len(request_id), self.max_request_id_length, "characters in x-request-id",
             "x-request-id")


def _cap(value: int, limit: int, what: str, param: str) -> None:
    if value > limit:
        raise InvalidParameterError(f"at most {limit} {what} allowed; got {value}", param)


API_KEY_ENV = "TOKENMILL_API_KEY"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    served_model_name: str | None = option(
        None, "the model's name in the API and the metrics (default: the model's own)")
    api_keys: tuple[str, ...] = option(
        (), "require 'Authorization: Bearer KEY' on /v1/*; repeat to accept several keys "
        f"(default: ${API_KEY_ENV}, if set)", flag="api-key")
    shutdown_timeout: float = option(
        30.0, "seconds requests in flight get to finish after SIGTERM")
    limits: RequestLimits = option(default_factory=RequestLimits, cli=False)
    default_continuous_usage_stats: bool = option(
        False, "streams without stream_options get usage on every chunk")
    metrics_vllm_names: bool = option(False, "also export metrics under vLLM's names")
    log_stats_interval: float = option(10.0, "seconds between the summary lines in the log")
    disable_log_stats: bool = option(
        False, "no summary lines, no engine or request stats in /metrics or the dashboard")
    ui_show_text: bool = option(
        False, "let /v1/requests/recent and the dashboard show prompts and outputs")
    tool_call_parser: str = option(
        "auto", "how tool calls are read from the model's text when tool_choice is auto: "
        "hermes (<tool_call> JSON, Hermes and Qwen), llama3_json (Llama 3 JSON), or auto "
        "(from the chat template)", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = option(
        None, "split the model's reasoning from its answer: deepseek_r1 or qwen3 "
        "(<think>...</think>), openai_gptoss (gpt-oss's analysis channel); default: none",
        choices=REASONING_PARSERS)
    embedding_pooling: str = option(
        "last", "how /v1/embeddings pools a prompt's hidden states (after the final norm): "
        "last (the last token's: a decoder's default), mean or cls (the first token's)",
        choices=POOLING_KINDS, flag="pooling")
    embedding_normalize: bool = option(
        True, "/v1/embeddings vectors scaled to unit length unless a request's normalize "
        "says otherwise")

    def __post_init__(self) -> None:
        if any(not isinstance(key, str) or not key.strip() for key in self.api_keys):
            raise InvalidParameterError("an API key must not be empty", "api_key")
        if not 0 <= self.port < 65536:
            raise InvalidParameterError(f"port must be in 0..65535, got {self.port}", "port")
        if self.shutdown_timeout < 0:
            raise InvalidParameterError("shutdown_timeout must not be negative",
                                        "shutdown_timeout")
        _one_of("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        _one_of("embedding_pooling", self.embedding_pooling, POOLING_KINDS)
        if self.reasoning_parser is not None:
            _one_of("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        if self.log_stats_interval <= 0:
            raise InvalidParameterError("log_stats_interval must be positive",
                                        "log_stats_interval")

    @property
    def stats(self) -> bool:
        """Whether the server keeps stats (metrics, log lines, the dashboard's history)."""
        return not self.disable_log_stats
