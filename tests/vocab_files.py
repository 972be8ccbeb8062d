"""Vocabulary-only GGUF files for tokenizer tests, and the corpus they are checked on.

``tests/data/vocab/`` holds llama.cpp's vocabulary-only file for Phi-3 (a SentencePiece
vocabulary with added and control tokens: ``phi-3.gguf``), the corpus (``corpus.txt``:
English, German, Japanese, code, emoji, whitespace runs; cases separated by
``CASE_SEPARATOR`` lines) and ``llama_cpp_ids.json``: the ids llama.cpp's
``llama-tokenize`` gives for each case, per file, as ``benchmarks/gguf_tokenizers.py``
writes them. ``without_space_prefix`` makes the Gemma-style variant of a SentencePiece
file (``tokenizer.ggml.add_space_prefix = false``); the same input gives the same bytes.
"""

from __future__ import annotations

import os

import gguf

VOCAB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "vocab")
CASE_SEPARATOR = "__case__"


def read_corpus(path: str = os.path.join(VOCAB_DIR, "corpus.txt")) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().split(f"\n{CASE_SEPARATOR}\n")


def without_space_prefix(source: str, target: str) -> str:
    """Copy the vocabulary-only GGUF ``source`` to ``target`` with
    ``tokenizer.ggml.add_space_prefix = false``; returns ``target``."""
    reader = gguf.GGUFReader(source)
    assert not reader.tensors, "only vocabulary-only files are copied"
    writer = gguf.GGUFWriter(target, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture",
                                               "tokenizer.ggml.add_space_prefix"):
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
