"""A tiny random-weight model folder with a real (small) tokenizer, for tests.

``make_tiny_model_dir(path, arch, **overrides)`` (``arch`` one of ``ARCHITECTURES``: llama,
qwen2, qwen3, mistral, phi3, gemma3, qwen3_moe, qwen2_moe, mixtral,
gpt_oss) writes, with fixed seeds:

- ``config.json`` + ``model.safetensors`` from ``transformers`` (2 layers, hidden 64, 4 heads,
  2 KV heads, vocab 512, tied embeddings; the head size is the config class's default:
  hidden / heads, but 128 for Qwen3 and 256 for Gemma 3; norm weights and biases perturbed
  so that they matter; the MoE architectures with ``TINY_EXPERTS``; ``overrides`` replace
  any config field);
- a byte-level BPE tokenizer trained on the English text below (vocab 400 <= model vocab),
  special tokens ``<|endoftext|>`` (id 0, bos/pad), ``<|im_start|>`` (1), ``<|im_end|>``
  (2, eos), and a ChatML chat template that renders tools (by name only: the tokenizer
  spends a token per character of JSON, and the tests' context is short), tool calls and
  tool results as Qwen2.5's does (``<tools>``, ``<tool_call>``, ``<tool_response>``); a
  conversation without them renders as plain ChatML.

The same arguments always give the same files, so tests may compare against fixed values.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# arch name -> (config class, model class)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
}
# The experts of the mixture-of-experts architectures' tiny models: 8 of width 32, 2 per token
TINY_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

# Llama 3.1-style rope scaling with a small original context, so tiny prompts feel it.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 400
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '<tools>' }}{% for tool in tools %}{{ ' ' + tool['function']['name'] }}{% endfor %}"
    "{{ ' </tools><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{{ '<|im_start|>assistant\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. A language model reads a prompt and writes
the next word, then the next, one token at a time. Servers batch many requests together
so that the hardware stays busy: while one user waits for a long answer, another request
joins the batch and leaves it when it is done. Hello, world! How are you today? I am fine,
thank you. What is the capital of France? The capital of France is Paris. Numbers such as
1, 2, 3, 10, 42, 100 and 2024 appear in text too. Once upon a time there was a little cat
who liked to sleep in the sun. Every morning she walked to the garden, looked at the
flowers, and listened to the birds. The weather was warm and the sky was blue. Tell me a
story about a robot who learns to paint. Write a short poem about the sea. Explain how a
computer adds two numbers. Water boils at one hundred degrees. The train leaves at nine
o'clock and arrives in the city before noon. She said: "Please close the door." He asked
why the lights were off; nobody knew. Tokens, blocks, caches and queues are the words of
this small test corpus, together with streaming, latency, throughput and usage.
"""


def train_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on ``TRAINING_TEXT``, wrapped for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in TRAINING_TEXT.splitlines() if line] * 4
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", **overrides) -> PretrainedConfig:
    fields = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.1,  # spread-out logits: greedy choices are not near-ties
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch.endswith("_moe"):
        fields.update(TINY_EXPERTS)
    fields.update(overrides)
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    return ARCHITECTURES[arch][0](**fields)


def make_tiny_model_dir(path: str | os.PathLike, arch: str = "llama", **overrides) -> str:
    """Write a tiny model + tokenizer folder at ``path`` and return it as a string."""
    path = os.fspath(path)
    config = tiny_config(arch, **overrides)
    model_cls = ARCHITECTURES[arch][1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config)
        with torch.no_grad():  # norms init to 1 and biases to 0: make them matter too
            for name, param in model.named_parameters():
                if name.endswith(("norm.weight", "bias")):
                    param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    train_tokenizer().save_pretrained(path)
    return path
