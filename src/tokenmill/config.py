"""Engine settings, validated once at start-up.

Every option has the CLI's name in snake_case (``--max-num-seqs`` -> ``max_num_seqs``),
so ``LLM(**options)``, ``tokenmill serve --...`` and ``EngineConfig(...)`` agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenmill.errors import InvalidParameterError

QUANTIZATION_CHOICES = ("none", "int8", "int4", "w4a8")
KERNEL_CHOICES = ("auto", "native", "torch")

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
               "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str | int, param: str = "kv_cache_memory") -> int:
    """Bytes from ``4GiB``, ``512M``, ``1073741824`` (binary units)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise InvalidParameterError(f"not a memory size: {text!r} (try 2GiB)", param)
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF folder or GGUF file; None: the embedded SmolLM2
    dtype: str = "auto"
    quantization: str = "none"  # "none", "int8", "int4" or "w4a8"
    device: str = "auto"
    num_threads: int | None = None  # compute threads; None: PyTorch's default (every core)
    kernels: str = "auto"  # "native" (CPU), "torch", or "auto": native where they build
    max_model_len: int | None = None  # None: the model's context length, capped at 8192
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    kv_cache_memory: str | int = "1GiB"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    max_num_queued_requests: int | None = None
    max_num_queued_tokens: int | None = None
    speculative_ngram: int = 0  # K: draft up to K tokens per step by prompt lookup; 0: off
    ngram_min: int = 2  # shortest suffix a lookup may match
    ngram_max: int = 4  # longest suffix a lookup tries first
    speculative_disable_by_batch_size: int = 4  # no drafts while more requests run

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def positive(name: str, value: int | None, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}",
                                            name)

        positive("block_size", self.block_size)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("max_model_len", self.max_model_len, allow_none=True)
        positive("num_threads", self.num_threads, allow_none=True)
        positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        positive("max_num_queued_requests", self.max_num_queued_requests, allow_none=True)
        positive("max_num_queued_tokens", self.max_num_queued_tokens, allow_none=True)
        if self.quantization not in QUANTIZATION_CHOICES:
            raise InvalidParameterError(
                f"unknown quantization {self.quantization!r} (choose one of: "
                f"{', '.join(QUANTIZATION_CHOICES)})", "quantization")
        if self.kernels not in KERNEL_CHOICES:
            raise InvalidParameterError(
                f"unknown kernels {self.kernels!r} (choose one of: "
                f"{', '.join(KERNEL_CHOICES)})", "kernels")
        positive("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size)
        positive("ngram_min", self.ngram_min)
        positive("ngram_max", self.ngram_max)
        if (not isinstance(self.speculative_ngram, int) or isinstance(self.speculative_ngram, bool)
                or self.speculative_ngram < 0):
            raise InvalidParameterError(
                f"speculative_ngram must be 0 (off) or a positive integer, got "
                f"{self.speculative_ngram!r}", "speculative_ngram")
        if self.ngram_min > self.ngram_max:
            raise InvalidParameterError(
                f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})",
                "ngram_min")
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
