"""``DecodeLayers`` (``NativeKernels.decode_layers``): a batch of decodes through every layer
in one native call gives the logits and the KV cache the layer modules give, bit for bit,
for every family whose graph it runs, in both dtypes and every quantization this host runs
(a GGUF file's own blocks too; where a quantization's weight format is not the native
kernels', the model takes the modules), also where the call splits many sequences between
its threads, and so does a batch with prompt rows where the native prefill attention takes
them; models it cannot run take the modules.

An option this host runs (``quantization_hosts.runs_here``, from the kernels' capabilities,
before building) that the loader refuses fails the test; only an option the host cannot run
is skipped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_writer import write_gguf
from paged_runner import PagedRunner

from quantization_hosts import gguf_integer_here, runs_here
from tiny_model import make_tiny_model_dir
from tokenmill.kernels import KernelUnavailableError
from tokenmill.kernels.native import split_rows_per_thread
from tokenmill.models.attention.native import NativePrefill
from tokenmill.models.loader import load_model
from tokenmill.models.weights.formats import KernelWeightFormat, StackedRowsWeight
from tokenmill.models.weights.quantizations import choose_weight_format, resolve_dtype

CPU = torch.device("cpu")
QUANTIZATIONS = ("none", "int8", "int4", "w4a8", "w8a8")
# the families whose graph the native call runs (Qwen3's QK-norm and Gemma 3's layers it
# does not: see test_qk_norm_takes_the_modules)
FAMILIES = ("llama", "qwen2", "mistral", "phi3")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# the weight classes a GGUF file of each type takes on a VNNI host
INTEGER_KINDS = {"Q8_0": {"NativeVnniQ8_0Weight"}, "Q4_1": {"NativeVnniW4A8Weight"},
                 "Q4_K": {"NativeVnniQ4KWeight", "NativeVnniQ6KWeight"}}


def load(model_dir: str, quantization: str, kernels, dtype: torch.dtype | None = None):
    """The model in ``dtype`` (default: ``--dtype auto``'s for the quantization); skipped
    only where the host cannot run the quantization in that dtype (``runs_here``), so a
    refusal where it can fails."""
    dtype = resolve_dtype("auto", CPU, quantization) if dtype is None else dtype
    if not runs_here(quantization, dtype, None if kernels is None else kernels.capabilities):
        pytest.skip(f"this CPU has no kernel for --quantization {quantization} in {dtype}")
    return load_model(model_dir, dtype, CPU, quantization, kernels=kernels)[0]


def fused_call_applies(quantization: str, dtype: torch.dtype, kernels) -> bool:
    """Whether every projection of the model takes a native kernel here (the weight
    format the table of quantizations chooses is the native kernels'), which the fused
    call needs."""
    return isinstance(choose_weight_format(dtype, CPU, quantization, kernels),
                      KernelWeightFormat)


def load_fused(model_dir: str, quantization: str, kernels):
    """``load`` in ``--dtype auto``'s dtype, where the fused call applies to the model
    (skipped elsewhere: ``test_one_native_call_equals_the_layer_modules`` covers that the
    modules run there); the model has it."""
    dtype = resolve_dtype("auto", CPU, quantization)
    if (runs_here(quantization, dtype, kernels.capabilities)
            and not fused_call_applies(quantization, dtype, kernels)):
        pytest.skip(f"--quantization {quantization} in {dtype} takes PyTorch's kernels here")
    model = load(model_dir, quantization, kernels, dtype)
    assert model.decode_layers is not None
    return model


def decode_steps(model, native: bool,
                 kv_int8: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of a prefill and then of decode steps (one token for each of three sequences
    of different lengths, then two tokens of one sequence: a speculative verification's
    rows), with ``decode_layers`` on or off for the decodes; and the KV caches at the end
    (8-bit ones where ``kv_int8``)."""
    stack = model.decode_layers
    runner = PagedRunner(model, block_size=4, kv_int8=kv_int8)
    logits = [runner.step([(0, list(range(30, 47))), (1, [5, 6, 7]), (2, list(range(60, 69)))])]
    model.decode_layers = stack if native else None
    try:
        for step in range(4):
            logits.append(runner.step([(0, [100 + step]), (1, [200 + step]), (2, [300 + step])]))
        logits.append(runner.step([(1, [11, 12])], all_tokens=True))
    finally:
        model.decode_layers = stack
    return logits, runner.kv_caches


def many_decode_steps(model, native: bool, streams: int, kv_int8: bool = False):
    """Logits of ``streams`` sequences' prompts (lengths 1 to 23), then of three decode
    steps of all of them and of a verification of two tokens each, with ``decode_layers``
    on or off for the decodes; and the KV caches at the end (8-bit ones where
    ``kv_int8``)."""
    stack = model.decode_layers
    runner = PagedRunner(model, num_blocks=streams * 7, block_size=4, kv_int8=kv_int8)
    logits = [runner.step([(s, [10 + (s * 7 + i) % 90 for i in range(1 + s % 23)])
                           for s in range(streams)])]
    model.decode_layers = stack if native else None
    try:
        for step in range(3):
            logits.append(runner.step([(s, [100 + (s + step) % 50]) for s in range(streams)]))
        logits.append(runner.step([(s, [11 + s % 7, 12]) for s in range(streams)],
                                  all_tokens=True, verify=True))
    finally:
        model.decode_layers = stack
    return logits, runner.kv_caches


class CountingLayers:
    """A model's ``decode_layers``, counting the batches with prompt rows it runs."""

    def __init__(self, stack) -> None:
        self.stack, self.mixed = stack, 0

    def run(self, *args):
        return self.stack.run(*args)

    def run_mixed(self, *args):
        self.mixed += 1
        return self.stack.run_mixed(*args)


def mixed_steps(model, native: bool, kv_int8: bool = False):
    """Logits of batches with prompt rows (three prompts alone; then decodes of two
    sequences beside a new prompt and the next chunk of an earlier one, whose first keys
    are in the cache; then a decode beside that new prompt's second chunk) and of a batch of
    decodes, with ``decode_layers`` on or off throughout; the KV caches at the end (8-bit
    ones where ``kv_int8``); and how many batches with prompt rows the native call ran."""
    stack = model.decode_layers
    counting = CountingLayers(stack)
    model.decode_layers = counting if native else None
    runner = PagedRunner(model, block_size=4, kv_int8=kv_int8)
    try:
        logits = [runner.step([(0, list(range(30, 47))), (1, [5, 6, 7]), (2, list(range(60, 69)))]),
                  runner.step([(0, [100]), (1, [200]), (3, list(range(10, 22))),
                               (2, list(range(70, 75)))]),
                  runner.step([(3, [40, 41, 42]), (0, [101])]),
                  runner.step([(s, [120 + s]) for s in range(4)])]
    finally:
        model.decode_layers = stack
    return logits, runner.kv_caches, counting.mixed


@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("quantization", ["none", "w8a8"])
def test_batches_with_prompt_rows_through_one_native_call_equal_the_layer_modules(
        tmp_path, native, quantization, kv_int8):
    """Where the native prefill attention takes prompt rows (heads of 64 here; AVX512-BF16,
    no AMX), the three batches with prompt rows run in one native call each; elsewhere
    they take the modules. Either way the logits and caches are the modules' bit for bit."""
    model_dir = make_tiny_model_dir(tmp_path, hidden_size=128, num_attention_heads=2,
                                    num_key_value_heads=1)
    model = load_fused(model_dir, quantization, native)
    native_logits, native_caches, mixed = mixed_steps(model, True, kv_int8)
    module_logits, module_caches, _ = mixed_steps(model, False, kv_int8)
    assert mixed == (3 if isinstance(model.attentions[0].prefill, NativePrefill) else 0)
    assert native_caches[0].dtype == (torch.int8 if kv_int8 else module_caches[0].dtype)
    for ours, theirs in zip(native_logits, module_logits, strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(native_caches, module_caches, strict=True):
        assert torch.equal(ours, theirs)


def assert_fused_call_equals_modules(model) -> None:
    """The same decode steps through the fused call and through the layer modules give the
    same logits and caches, bit for bit."""
    native_logits, native_caches = decode_steps(model, native=True)
    module_logits, module_caches = decode_steps(model, native=False)
    for ours, theirs in zip(native_logits, module_logits, strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(native_caches, module_caches, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_one_native_call_equals_the_layer_modules(tiny_model_dir, native, variant, dtype,
                                                  quantization):
    model = load(tiny_model_dir(variant), quantization, native, DTYPES[dtype])
    if not fused_call_applies(quantization, DTYPES[dtype], native):
        assert model.decode_layers is None  # PyTorch's kernels: the modules run
        return
    assert model.decode_layers is not None
    assert_fused_call_equals_modules(model)


# a GGUF file's own blocks (--quantization gguf): Q8_0 (a scale per 32 inputs) and Q4_1
# (one 4-bit plane), and a Q4_K_M-like mix (Q4_K, Q6_K for a v, whose qkv is packed in
# parts, a down projection and the untied head), on the integer kernels of a VNNI host
# (quantization_hosts.gguf_integer_here), else the weight-only int8 and int4 ones
Q4_K_M = {"blk.0.attn_v.weight": GGMLQuantizationType.Q6_K,
          "blk.1.ffn_down.weight": GGMLQuantizationType.Q6_K,
          "output.weight": GGMLQuantizationType.Q6_K}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K"])
def test_one_native_call_on_a_gguf_files_blocks_equals_the_layer_modules(
        tiny_model_dir, tmp_path, native, dtype, qtype):
    if not native.capabilities.linear(DTYPES[dtype]):
        pytest.skip(f"this CPU has no native linear kernels for {dtype}: no gguf")
    path = str(tmp_path / "m.gguf")
    if qtype == "Q4_K":  # K-quants: rows of whole super-blocks of 256
        hf_dir = make_tiny_model_dir(tmp_path / "hf", "llama", hidden_size=256,
                                     intermediate_size=512, tie_word_embeddings=False)
        write_gguf(hf_dir, path, GGMLQuantizationType.Q4_K, overrides=Q4_K_M)
    else:
        write_gguf(tiny_model_dir("llama"), path, GGMLQuantizationType[qtype])
    model = load_model(path, DTYPES[dtype], CPU, "gguf", native)[0]
    if gguf_integer_here(native.capabilities):
        assert {type(part).__name__ for layer in model.model.layers
                for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                          layer.mlp.gate_up_proj, layer.mlp.down_proj)
                for part in getattr(p.packed, "parts", [p.packed])} == INTEGER_KINDS[qtype]
    assert model.decode_layers is not None
    assert_fused_call_equals_modules(model)


@pytest.mark.parametrize("variant", ["llama", "mistral"])
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_sequences_split_between_threads_equal_the_layer_modules(tiny_model_dir, native,
                                                                 variant, quantization):
    """With enough decode tokens a thread, each one of its own sequence, each thread takes
    its own share of the sequences through every layer (shares of unequal sizes here;
    where the linear kernels use AMX tiles the call never splits, and the same batches
    check that); a verification's rows, which attend to each other's keys and values,
    do not split."""
    model = load_fused(tiny_model_dir(variant), quantization, native)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        streams = (split_rows_per_thread(native.capabilities) or 16) * 2 + 3
        native_logits, native_caches = many_decode_steps(model, True, streams)
        module_logits, module_caches = many_decode_steps(model, False, streams)
    finally:
        torch.set_num_threads(threads)
    for ours, theirs in zip(native_logits, module_logits, strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(native_caches, module_caches, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("quantization", ["none", "w8a8"])
def test_an_8_bit_cache_through_one_native_call_equals_the_layer_modules(
        tiny_model_dir, native, quantization):
    """The same with the KV cache in 8-bit rows: a few sequences, and enough of them that
    each of two threads takes its own share."""
    model = load_fused(tiny_model_dir("llama"), quantization, native)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        streams = (split_rows_per_thread(native.capabilities) or 16) * 2 + 3
        runs = [(decode_steps(model, True, kv_int8=True), decode_steps(model, False, kv_int8=True)),
                (many_decode_steps(model, True, streams, kv_int8=True),
                 many_decode_steps(model, False, streams, kv_int8=True))]
    finally:
        torch.set_num_threads(threads)
    for (native_logits, native_caches), (module_logits, module_caches) in runs:
        assert native_caches[0].dtype == torch.int8
        for ours, theirs in zip(native_logits, module_logits, strict=True):
            assert torch.equal(ours, theirs)
        for ours, theirs in zip(native_caches, module_caches, strict=True):
            assert torch.equal(ours, theirs)


def test_a_thread_done_early_takes_half_of_another_threads_rows(tmp_path, native):
    """Sequences of very unequal contexts, the first thread's share over one key each and
    the second's over hundreds: the first thread, done early, takes half of the second's
    rows at a layer boundary (and the halves may halve again), and the logits and caches
    are still the modules' bit for bit."""
    rows = split_rows_per_thread(native.capabilities)
    if not rows:
        pytest.skip("the linear kernels use AMX tiles here: the call never splits")
    model = load_fused(make_tiny_model_dir(tmp_path, num_hidden_layers=8), "none", native)
    streams, long_prompt = 2 * rows, 400
    prompts = [(s, [10 + (s + i) % 90 for i in range(1 if s < rows else long_prompt)])
               for s in range(streams)]

    def decode(native_layers: bool):
        stack = model.decode_layers
        runner = PagedRunner(model, num_blocks=rows * (long_prompt // 4 + 4) + streams * 4,
                             block_size=4)
        logits = [runner.step(prompts)]
        model.decode_layers = stack if native_layers else None
        try:
            for step in range(4):
                logits.append(runner.step([(s, [100 + (s + step) % 50])
                                           for s in range(streams)]))
        finally:
            model.decode_layers = stack
        return logits, runner.kv_caches

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        handed_before = model.decode_layers.handover_count()
        native_logits, native_caches = decode(True)
        handed = model.decode_layers.handover_count() - handed_before
        module_logits, module_caches = decode(False)
    finally:
        torch.set_num_threads(threads)
    assert handed > 0
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


def test_a_build_without_the_fused_call_takes_the_modules(tiny_model_dir, native):
    """The fused call is reached through the kernel door alone: where the capabilities
    record has no ``decode_layers``, the door refuses it and the model runs its modules."""
    without = dataclasses.replace(native, capabilities=dataclasses.replace(
        native.capabilities, decode_layers=False))
    with pytest.raises(KernelUnavailableError):
        without.decode_layers(1e-6, 2, 1, 64, 0.125, 0)
    assert native.capabilities.decode_layers
    model = load(tiny_model_dir("llama"), "none", without)
    assert model.decode_layers is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_projection_packed_in_parts_runs_in_the_native_call(tmp_path, native, dtype):
    """A Q4_K_M file's fused qkv of a Q4_K q and k beside a Q6_K v is packed in parts
    (``StackedRowsWeight``); the fused call binds one op a part, and equals the modules."""
    if not native.capabilities.linear(DTYPES[dtype]):
        pytest.skip(f"this CPU has no native linear kernels for {dtype}: no gguf")
    path = str(tmp_path / "m.gguf")
    hf_dir = make_tiny_model_dir(tmp_path / "hf", "llama", hidden_size=256,
                                 intermediate_size=512, tie_word_embeddings=False)
    write_gguf(hf_dir, path, GGMLQuantizationType.Q4_K,
               overrides={"blk.0.attn_v.weight": GGMLQuantizationType.Q6_K})
    model = load_model(path, DTYPES[dtype], CPU, "gguf", native)[0]
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.packed, StackedRowsWeight)
    assert model.decode_layers is not None
    assert_fused_call_equals_modules(model)
