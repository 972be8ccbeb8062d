"""The model's tokenizer and chat template, loaded from a Hugging Face folder or a GGUF file.

``load_tokenizer(model_path)`` accepts:

- ``None``: the embedded SmolLM2-135M-Instruct GGUF (``model_source.default_model_path``);
- a ``.gguf`` file: vocabulary, merges, special tokens and chat template come from the
  file's metadata (byte-level BPE vocabularies are built by ``gguf_vocab``, SentencePiece
  ones by ``gguf_sentencepiece``, both as llama.cpp tokenizes; any other kind is an error
  naming what is supported);
- a folder with ``tokenizer.json``: the Hugging Face tokenizer, its chat template
  (``tokenizer_config.json`` or ``chat_template.jinja``), its special tokens and the EOS
  ids of ``generation_config.json`` (Llama 3 lists several).

Both read with the ``tokenizers`` library and render templates with jinja2
(``chat_template``), so the HTTP process that tokenises never imports transformers or
torch. Only a folder with a SentencePiece ``tokenizer.model`` and no ``tokenizer.json`` is
converted by transformers, which imports torch; the log says so.

Nothing is downloaded. ``Tokenizer`` methods call the Rust backend directly (no
per-call Python setup, no state changed by a call), so calling them from the asyncio
thread costs microseconds per short text. Decoding never applies transformers'
``clean_up_tokenization_spaces``: text is exactly what the tokens spell, identical
whether it is decoded at once or incrementally.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
from tokenizers import Tokenizer as Backend

from tokenmill.errors import InvalidParameterError
from tokenmill.model_source import default_model_path
from tokenmill.tokenizer.chat_template import ChatTemplate
from tokenmill.tokenizer.gguf_sentencepiece import build_sentencepiece, supports_sentencepiece
from tokenmill.tokenizer.gguf_tokens import end_of_generation_ids
from tokenmill.tokenizer.gguf_vocab import (
    PRE_TOKENIZERS,
    build_byte_level_bpe,
    read_gguf_metadata,
    supports_byte_level_bpe,
)

logger = logging.getLogger("tokenmill")

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_GGUF_SPECIAL_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id",
                      "eos_token": "tokenizer.ggml.eos_token_id",
                      "unk_token": "tokenizer.ggml.unknown_token_id",
                      "pad_token": "tokenizer.ggml.padding_token_id"}


class Tokenizer:
    """A ``tokenizers`` backend plus what serving needs from it.

    Invariants: ``eos_token_ids`` holds only ids of the vocabulary; ``vocab_size`` counts
    added tokens; instances are never mutated after construction, so one instance may be
    shared by threads.
    """

    def __init__(self, backend: Backend, eos_token_ids: Iterable[int], source: str,
                 chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None) -> None:
        self.backend = backend
        self.source = source
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = frozenset(i for i in eos_token_ids if 0 <= i < self.vocab_size)
        self.chat_template = chat_template or None
        # the template sees the special tokens by name (bos_token, eos_token, ...)
        self._template = (None if self.chat_template is None
                          else _compile(self.chat_template, source, special_tokens or {}))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (the model can be shown them)."""
        return isinstance(self._template, ChatTemplate) and self._template.supports_tools

    def render_chat(self, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The chat template's text for ``messages`` (see ``apply_chat_template``), with
        ``tools`` (OpenAI's tool objects) for a template that renders them."""
        if isinstance(self._template, ValueError):
            raise self._template
        if self._template is None:
            raise ValueError(f"{self.source}: the tokenizer has no chat template; "
                             "use the completions API or a model that ships one")
        conversation = [_flatten_message(m) for m in _check_messages(messages)]
        try:
            return self._template.render(conversation, add_generation_prompt,
                                         tools=list(tools) if tools else None)
        except jinja2.TemplateError as e:  # raise_exception() in a template: bad conversation
            raise InvalidParameterError(f"chat template rejected the messages: {e}",
                                        "messages") from e

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered conversation.

        A message's ``content`` is a string, None (an empty turn), or a list of content
        parts of which only ``{"type": "text", "text": ...}`` is accepted; text parts are
        joined with newlines, as vLLM does. The template writes any BOS itself, so the
        rendered text is encoded without adding special tokens.
        """
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)


def _compile(template: str, source: str,
             special_tokens: Mapping[str, str]) -> ChatTemplate | ValueError:
    """The compiled template, or the error that every chat request will report (a model
    with a broken template still serves completions)."""
    try:
        return ChatTemplate(template, special_tokens)
    except ValueError as e:
        return ValueError(f"{source}: {e}")


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
    config = _read_json(os.path.join(folder, "tokenizer_config.json")) or {}
    special = {name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
               if (text := _token_text(config.get(name))) is not None}
    template = _config_template(config.get("chat_template"))
    template_file = os.path.join(folder, "chat_template.jinja")
    if not template and os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            template = f.read()
    tokenizer_file = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(tokenizer_file):
        try:
            backend = Backend.from_file(tokenizer_file)
        except Exception as e:  # noqa: BLE001 - the Rust loader's errors have no common base
            raise ValueError(f"cannot load the tokenizer in {folder}: {e}") from None
    else:
        backend, template, special = _convert_with_transformers(folder, template, special)
    eos_ids = {backend.token_to_id(special["eos_token"])} if "eos_token" in special else set()
    generation = _read_json(os.path.join(folder, "generation_config.json")) or {}
    listed = generation.get("eos_token_id")
    eos_ids.update(listed if isinstance(listed, list) else [] if listed is None else [listed])
    return Tokenizer(backend, (i for i in eos_ids if i is not None), folder, template, special)


def _load_gguf(path: str) -> Tokenizer:
    metadata = read_gguf_metadata(path)
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{path} carries no tokenizer metadata")
    tokens = metadata["tokenizer.ggml.tokens"]
    special = {name: tokens[metadata[key]] for name, key in _GGUF_SPECIAL_KEYS.items()
               if key in metadata and 0 <= metadata[key] < len(tokens)}
    template = metadata.get("tokenizer.chat_template")
    if supports_byte_level_bpe(metadata):
        backend = build_byte_level_bpe(metadata)
    elif supports_sentencepiece(metadata):
        backend = build_sentencepiece(metadata)
    else:
        raise ValueError(f"{path}: {_unsupported_vocabulary(metadata)}")
    return Tokenizer(backend, end_of_generation_ids(metadata), path, template, special)


def _unsupported_vocabulary(metadata: dict[str, Any]) -> str:
    """One line: which GGUF vocabulary this is and which ones are served."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        pre = metadata.get("tokenizer.ggml.pre", "default")
        return (f"its byte-level BPE vocabulary names the pre-tokenizer {pre!r}, which is "
                f"not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    return (f"its vocabulary kind tokenizer.ggml.model = {kind!r} is not supported "
            "(supported: 'gpt2', byte-level BPE, and 'llama', SentencePiece)")


def _convert_with_transformers(folder: str, template: str | None, special: dict[str, str]
                               ) -> tuple[Backend, str | None, dict[str, str]]:
    """A folder's SentencePiece ``tokenizer.model`` without ``tokenizer.json``, converted
    by transformers: its backend, template and special tokens."""
    logger.info("%s: converting the tokenizer with transformers (this imports torch)", folder)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                           use_fast=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer in {folder}: {e}") from e
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{folder}: only fast (tokenizer.json) tokenizers are supported")
    named = {name: value for name in ("bos_token", "eos_token", "unk_token", "pad_token")
             if isinstance(value := getattr(hf, name, None), str)}
    return backend, template or hf.chat_template, {**named, **special}


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return value if isinstance(value, dict) else None


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: text, or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(value: Any) -> str | None:
    """``chat_template`` of ``tokenizer_config.json``: a string, or a list of named
    templates of which the one named ``default`` is the chat template."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None
