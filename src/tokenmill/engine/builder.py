"""Assemble a ready engine core from an ``EngineConfig``: model, KV cache size, model runner
and the core over them. (The tokenizer is not the engine's: whoever tokenises loads it.)"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.engine_core import EngineCore
from tokenmill.core.records import SchedulerStats
from tokenmill.engine.cpu_share import usable_cpus
from tokenmill.engine.messages import EngineInfo
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.errors import InvalidParameterError
from tokenmill.hardware import pick_device
from tokenmill.kernels import choose_kernels
from tokenmill.model_source import default_model_path, model_name_for
from tokenmill.models.attention.kv_int8 import row_width
from tokenmill.models.config import ModelConfig
from tokenmill.models.loader import load_model
from tokenmill.models.weights.quantizations import resolve_dtype, resolve_quantization
from tokenmill.resident_memory import resident_bytes

logger = logging.getLogger("tokenmill")

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class BuiltCore:
    """An engine core over its loaded model, and what its clients need to know of it."""

    core: EngineCore
    info: EngineInfo  # what a client of the engine needs to know (model name, sizes)
    device: torch.device


def build_core(config: EngineConfig,
               on_scheduled: Callable[[SchedulerStats], None] | None = None) -> BuiltCore:
    """The engine core ``config`` describes (``on_scheduled``: its hook, see ``EngineCore``).
    Sets this process's PyTorch compute threads: ``num_threads`` when given, else no more
    than ``usable_cpus`` (PyTorch follows the affinity mask on its own, not a cgroup
    quota)."""
    torch.set_num_threads(config.num_threads
                          or min(torch.get_num_threads(), usable_cpus()))
    device = pick_device() if config.device == "auto" else torch.device(config.device)
    kernels = choose_kernels(config.kernels, device)
    quantization = resolve_quantization(config.quantization,
                                        config.model or default_model_path(), config.dtype,
                                        device, kernels, config.batch_invariant)
    dtype = resolve_dtype(config.dtype, device, quantization)
    model, model_config = load_model(config.model, dtype, device, quantization, kernels,
                                     config.batch_invariant)
    max_model_len = _max_model_len(config, model_config)
    kv_int8 = config.kv_cache_dtype == "int8"
    num_blocks = _num_kv_blocks(config, model_config, dtype, kv_int8, max_model_len)
    runner = ModelRunner(model, device, dtype, num_blocks, config.block_size, seed=config.seed,
                         kernels=kernels, batch_invariant=config.batch_invariant,
                         kv_int8=kv_int8)
    core = EngineCore(config, runner, num_blocks, max_model_len, model_config.kv_window,
                      on_scheduled)
    logger.info("model %s on %s (%s, quantization %s, kernels %s): %d KV blocks of %d "
                "tokens (%s, %.2f GiB), max_model_len %d; resident memory %s",
                model_name_for(config.model), device, str(dtype).removeprefix("torch."),
                quantization, "torch" if kernels is None else "native", num_blocks,
                config.block_size, "int8" if kv_int8 else "the model's dtype",
                num_blocks * kv_block_bytes(model_config, config.block_size, dtype, kv_int8)
                / 2**30, max_model_len, _gib(resident_bytes()))
    info = EngineInfo(model_name_for(config.model), max_model_len, model_config.vocab_size,
                      num_blocks * config.block_size, config.scheduling_policy)
    return BuiltCore(core, info, device)


def _max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if config.max_model_len > limit:
        raise InvalidParameterError(
            f"max_model_len {config.max_model_len} exceeds the model's context length {limit}",
            "max_model_len")
    return config.max_model_len


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                   kv_int8: bool) -> int:
    """The bytes of one KV-cache block over every layer (keys and values; rows as
    ``kv_int8`` or ``dtype`` stores them)."""
    row_bytes = (row_width(model_config.head_dim, True) if kv_int8
                 else model_config.head_dim * torch.finfo(dtype).bits // 8)
    return (2 * block_size * model_config.num_key_value_heads * row_bytes
            * model_config.num_hidden_layers)


def _gib(size: int | None) -> str:
    return "unknown" if size is None else f"{size / 2**30:.2f} GiB"


def _num_kv_blocks(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                   kv_int8: bool, max_model_len: int) -> int:
    """Blocks from --num-kv-blocks, else from --kv-cache-memory (a block's bytes as
    ``kv_int8`` or ``dtype`` stores it); at least one full sequence."""
    bytes_per_block = kv_block_bytes(model_config, config.block_size, dtype, kv_int8)
    num_blocks = config.num_kv_blocks or config.kv_cache_memory_bytes // bytes_per_block
    needed = -(-max_model_len // config.block_size)
    if num_blocks < needed:
        raise InvalidParameterError(
            f"the KV cache holds {num_blocks} blocks of {config.block_size} tokens, fewer than one "
            f"sequence of max_model_len {max_model_len} needs ({needed}): raise "
            "--kv-cache-memory / --num-kv-blocks or lower --max-model-len", "kv_cache_memory")
    return num_blocks
