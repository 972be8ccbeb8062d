"""The model's tokenizer and chat template, loaded from a Hugging Face folder or a GGUF file.

``load_tokenizer(model_path)`` accepts:

- ``None``: the embedded SmolLM2-135M-Instruct GGUF (``models.loader.default_model_path``);
- a ``.gguf`` file: vocabulary, merges, special tokens and chat template come from the
  file's metadata (byte-level BPE vocabularies are built by ``gguf_vocab``, others by
  transformers' GGUF conversion);
- a folder with ``tokenizer.json`` (or ``tokenizer_config.json``): the Hugging Face
  tokenizer, its chat template (``tokenizer_config.json`` or ``chat_template.jinja``) and
  the EOS ids of ``generation_config.json`` (Llama 3 lists several).

Nothing is downloaded. ``Tokenizer`` methods encode and decode through the Rust
``tokenizers`` backend directly (no per-call Python setup, no state changed by a call),
so calling them from the asyncio thread costs microseconds per short text. Decoding never
applies transformers' ``clean_up_tokenization_spaces``: text is exactly what the tokens
spell, identical whether it is decoded at once or incrementally.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tokenmill.errors import InvalidParameterError
from tokenmill.models.loader import default_model_path
from tokenmill.tokenizer.gguf_vocab import (
    build_byte_level_bpe,
    read_gguf_metadata,
    supports_byte_level_bpe,
)

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                  "tokenizer.ggml.eom_token_id")


class Tokenizer:
    """A fast Hugging Face tokenizer plus what serving needs from it.

    Invariants: ``eos_token_ids`` is non-empty only with ids of the vocabulary;
    ``vocab_size == len(hf)`` counts added tokens; instances are never mutated after
    construction, so one instance may be shared by threads.
    """

    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: Iterable[int],
                 source: str) -> None:
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{source}: only fast (tokenizer.json) tokenizers are supported")
        self.hf = hf
        self.source = source
        self._backend = backend
        self.vocab_size = len(hf)
        self.eos_token_ids = frozenset(i for i in eos_token_ids if 0 <= i < self.vocab_size)
        self.bos_token_id: int | None = hf.bos_token_id
        self.all_special_ids = frozenset(hf.all_special_ids)

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template or None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._backend.id_to_token(i) or "" for i in ids]

    def render_chat(self, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (see ``apply_chat_template``)."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: the tokenizer has no chat template; "
                             "use the completions API or a model that ships one")
        conversation = [_flatten_message(m) for m in _check_messages(messages)]
        try:
            return self.hf.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{self.source}: the chat template is not valid Jinja: {e}") from e
        except jinja2.TemplateError as e:  # raise_exception() in a template: bad conversation
            raise InvalidParameterError(f"chat template rejected the messages: {e}",
                                        "messages") from e

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation.

        A message's ``content`` is a string, None (an empty turn), or a list of content
        parts of which only ``{"type": "text", "text": ...}`` is accepted; text parts are
        joined with newlines, as vLLM does. The template writes any BOS itself, so the
        rendered text is encoded without adding special tokens.
        """
        text = self.render_chat(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def _check_messages(messages: Sequence[dict[str, Any]]) -> Sequence[dict[str, Any]]:
    if not isinstance(messages, list | tuple) or not messages:
        raise InvalidParameterError("messages must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidParameterError("each message needs a string 'role'", "messages")
    return messages


def _flatten_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return {**message, "content": content or ""}
    if not isinstance(content, list):
        raise InvalidParameterError("message content must be a string or a list of parts",
                                    "messages")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidParameterError(f"unsupported content part type {kind!r}: "
                                        "only 'text' parts are accepted", "messages")
        if not isinstance(part.get("text"), str):
            raise InvalidParameterError("a text content part needs a string 'text'", "messages")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def load_tokenizer(model_path: str | None) -> Tokenizer:
    """Load the tokenizer of ``model_path``; each source is loaded once per process."""
    path = os.path.realpath(default_model_path() if model_path is None else model_path)
    return _load_cached(*_resolve_source(path))


def _resolve_source(path: str) -> tuple[str, str]:
    """("gguf", file) or ("hf", folder): the same sources the model loader accepts."""
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: expected a .gguf file or a model folder")
        return "gguf", path
    if not os.path.isdir(path):
        raise ValueError(f"model path {path} does not exist")
    if any(os.path.isfile(os.path.join(path, f)) for f in _HF_TOKENIZER_FILES):
        return "hf", path
    raise ValueError(f"{path} has no tokenizer files (tokenizer.json, tokenizer_config.json)")


@functools.lru_cache(maxsize=8)
def _load_cached(kind: str, path: str) -> Tokenizer:
    return _load_gguf(path) if kind == "gguf" else _load_hf_folder(path)


def _load_hf_folder(folder: str) -> Tokenizer:
    try:
        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True, use_fast=True,
                                           trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer in {folder}: {e}") from e
    template_file = os.path.join(folder, "chat_template.jinja")
    if not hf.chat_template and os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            hf.chat_template = f.read()
    eos_ids = {hf.eos_token_id} if hf.eos_token_id is not None else set()
    gen_config = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_config):
        with open(gen_config, encoding="utf-8") as f:
            listed = json.load(f).get("eos_token_id")
        eos_ids.update(listed if isinstance(listed, list) else [] if listed is None else [listed])
    return Tokenizer(hf, eos_ids, source=folder)


def _load_gguf(path: str) -> Tokenizer:
    metadata = read_gguf_metadata(path)
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{path} carries no tokenizer metadata")
    if supports_byte_level_bpe(metadata):
        hf = _wrap_byte_level_bpe(metadata)
    else:  # SentencePiece and other vocabularies: transformers' GGUF conversion
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                           gguf_file=os.path.basename(path),
                                           local_files_only=True)
    eos_ids = [metadata[k] for k in _GGUF_EOS_KEYS if k in metadata]
    return Tokenizer(hf, eos_ids, source=path)


def _wrap_byte_level_bpe(metadata: dict[str, Any]) -> PreTrainedTokenizerFast:
    tokens = metadata["tokenizer.ggml.tokens"]
    named = {name: tokens[metadata[key]] for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ) if key in metadata}
    return PreTrainedTokenizerFast(tokenizer_object=build_byte_level_bpe(metadata),
                                   chat_template=metadata.get("tokenizer.chat_template"),
                                   clean_up_tokenization_spaces=False, **named)
