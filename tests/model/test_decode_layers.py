"""``DecodeLayers``: a batch of decodes through every layer in one native call gives the
logits and the KV cache the layer modules give, bit for bit, in every weight format this
host runs; models it cannot run take the modules."""

from __future__ import annotations

import pytest
import torch
from paged_runner import PagedRunner

from tokenmill.errors import InvalidParameterError
from tokenmill.hardware import resolve_dtype
from tokenmill.models.loader import load_model

CPU = torch.device("cpu")
QUANTIZATIONS = ("none", "int8", "int4", "w4a8", "w8a8")


def load(model_dir: str, quantization: str, kernels):
    dtype = resolve_dtype("auto", CPU, quantization)
    try:
        model, _ = load_model(model_dir, dtype, CPU, quantization, kernels=kernels)
    except InvalidParameterError as error:
        pytest.skip(f"--quantization {quantization} does not run here: {error}")
    return model


def decode_steps(model, native: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of a prefill and then of decode steps (one token for each of three sequences
    of different lengths, then two tokens of one sequence: a speculative verification's
    rows), with ``decode_layers`` on or off for the decodes; and the KV caches at the end."""
    stack = model.decode_layers
    runner = PagedRunner(model, block_size=4)
    logits = [runner.step([(0, list(range(30, 47))), (1, [5, 6, 7]), (2, list(range(60, 69)))])]
    model.decode_layers = stack if native else None
    try:
        for step in range(4):
            logits.append(runner.step([(0, [100 + step]), (1, [200 + step]), (2, [300 + step])]))
        logits.append(runner.step([(1, [11, 12])], all_tokens=True))
    finally:
        model.decode_layers = stack
    return logits, runner.kv_caches


@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral", "phi3"])
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_one_native_call_equals_the_layer_modules(tiny_model_dir, native, variant,
                                                  quantization):
    model = load(tiny_model_dir(variant), quantization, native)
    assert model.decode_layers is not None
    native_logits, native_caches = decode_steps(model, native=True)
    module_logits, module_caches = decode_steps(model, native=False)
    for ours, theirs in zip(native_logits, module_logits, strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(native_caches, module_caches, strict=True):
        assert torch.equal(ours, theirs)


def test_qk_norm_takes_the_modules(tiny_model_dir, native):
    """Qwen3's per-head QK-norm is a step the native call does not take."""
    model = load(tiny_model_dir("qwen3"), "none", native)
    assert model.decode_layers is None


def test_pytorch_kernels_take_the_modules(tiny_model_dir):
    model = load(tiny_model_dir("llama"), "none", None)
    assert model.decode_layers is None
