"""Read a GGUF file's metadata and build the byte-level BPE tokenizer it describes.

A GGUF file starts with its key/value metadata, before the tensor descriptions::

    "GGUF" | version u32 | tensor_count u64 | kv_count u64 | kv_count x (key, type u32, value)
    key/string = length u64 + UTF-8 bytes;  array = element type u32 + count u64 + elements

``read_gguf_metadata`` parses only that part (a few hundred kilobytes), so reading
the vocabulary of a large model takes tens of milliseconds.

``build_byte_level_bpe`` builds a ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*``
keys when ``tokenizer.ggml.model == "gpt2"`` and the pre-tokenizer (``tokenizer.ggml.pre``)
is one of ``PRE_TOKENIZERS``. Each entry splits text exactly as llama.cpp does for that
name, which is also how the original Hugging Face tokenizer splits it.

NOTE: transformers' own GGUF conversion ignores the "smollm" pre-tokenizer and splits
with the plain GPT-2 pattern, which turns "  2" into three tokens instead of two; this
module exists so the embedded SmolLM2 model sees the tokens it was trained on.
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from tokenmill.tokenizer.gguf_tokens import add_added_tokens, add_bos

_SCALAR_FORMATS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i",
    6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_STRING, _ARRAY = 8, 9

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(*patterns: str) -> pre_tokenizers.PreTokenizer:
    """Split by each pattern in turn (isolating matches), then map bytes to symbols."""
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=False)])


_SMOLLM = _split_then_bytes(r"\p{N}", _GPT2_SPLIT)  # every digit on its own, then GPT-2
_LLAMA3 = _split_then_bytes(_LLAMA3_SPLIT)
_QWEN2 = _split_then_bytes(_QWEN2_SPLIT)
_QWEN35 = _split_then_bytes(_QWEN35_SPLIT)
_GPT2 = _split_then_bytes(_GPT2_SPLIT)

PRE_TOKENIZERS: dict[str, pre_tokenizers.PreTokenizer] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "smollm": _SMOLLM,
    "starcoder": _SMOLLM,
    "refact": _SMOLLM,
    "codeshell": _SMOLLM,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "pixtral": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "qwen35": _QWEN35,
}
# Pre-tokenizers whose words are looked up whole before any merge (llama.cpp's
# ``ignore_merges``; ``"ignore_merges": true`` in the original tokenizer.json)
IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "pixtral"})
# Pre-tokenizers whose files want a BOS token unless they say otherwise
ADD_BOS_BY_DEFAULT = IGNORE_MERGES


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (arrays as lists). ValueError if not GGUF v2+."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        reader = _MetadataReader(f)
        version = reader.scalar("I")
        if not 2 <= version <= 3:
            raise ValueError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
        reader.scalar("Q")  # tensor count
        num_kv = reader.scalar("Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("I"))
        return metadata


class _MetadataReader:
    """Little-endian GGUF value decoder over a binary file."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f

    def _read(self, size: int) -> bytes:
        data = self._f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF metadata")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self._read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self._read(self.scalar("Q")).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            elem_type, count = self.scalar("I"), self.scalar("Q")
            if elem_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[elem_type]
                data = self._read(count * struct.calcsize(fmt))
                return list(struct.unpack(f"<{count}{fmt}", data))
            return [self.value(elem_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        return self.scalar(_SCALAR_FORMATS[value_type])


def supports_byte_level_bpe(metadata: dict[str, Any]) -> bool:
    """Whether ``build_byte_level_bpe`` reproduces this file's tokenizer exactly."""
    return (metadata.get("tokenizer.ggml.model") == "gpt2"
            and "tokenizer.ggml.merges" in metadata
            and metadata.get("tokenizer.ggml.pre", "default") in PRE_TOKENIZERS)


def build_byte_level_bpe(metadata: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer of a ``supports_byte_level_bpe`` file.

    Added tokens are ``gguf_tokens``'. When the file asks for a BOS token
    (``tokenizer.ggml.add_bos_token``; by default with the Llama 3 pre-tokenizers, as in
    llama.cpp) a post-processor puts it in front of every encoding made with
    ``add_special_tokens=True``.
    """
    assert supports_byte_level_bpe(metadata), "caller checks supports_byte_level_bpe"
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre in IGNORE_MERGES))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]
    tok.decoder = decoders.ByteLevel()
    add_added_tokens(tok, metadata)
    add_bos(tok, metadata, default=pre in ADD_BOS_BY_DEFAULT)
    return tok
