"""GGUF vocabularies tokenize as llama.cpp tokenizes them, id for id.

The expected ids are llama.cpp's: ``tests/data/vocab/llama_cpp_ids.json`` (``llama-tokenize``
on the corpus, written by ``benchmarks/gguf_tokenizers.py``) and llama.cpp's own test
vectors for the Phi-3 vocabulary (``phi-3.gguf.inp``/``.out``). With
``TOKENMILL_LLAMA_CPP_VOCABS`` naming llama.cpp's ``models/`` folder, every
``ggml-vocab-*.gguf`` there whose vocabulary tokenmill serves is checked against its
``.inp``/``.out`` vectors too.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from tokenmill.model_source import default_model_path
from tokenmill.tokenizer.gguf_sentencepiece import supports_sentencepiece
from tokenmill.tokenizer.gguf_vocab import read_gguf_metadata, supports_byte_level_bpe
from tokenmill.tokenizer.tokenizer import load_tokenizer
from vocab_files import VOCAB_DIR, read_corpus, without_space_prefix

PHI3 = os.path.join(VOCAB_DIR, "phi-3.gguf")
LLAMA_CPP_VOCABS = os.environ.get("TOKENMILL_LLAMA_CPP_VOCABS")
VECTOR_SEPARATOR = "\n__ggml_vocab_test__\n"


def llama_cpp_ids(name: str) -> list[list[int]]:
    with open(os.path.join(VOCAB_DIR, "llama_cpp_ids.json"), encoding="utf-8") as f:
        return {r["file"]: r["llama_cpp_ids"] for r in json.load(f)["results"]}[name]


def read_vectors(path: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test vectors for a vocabulary file: (text, ids without BOS)."""
    with open(path + ".inp", encoding="utf-8") as f:
        texts = f.read().split(VECTOR_SEPARATOR)
    with open(path + ".out", encoding="utf-8") as f:
        ids = [[int(i) for i in line.split()] for line in f.read().split("\n")]
    return list(zip(texts, ids[:len(texts)], strict=True))


@pytest.mark.parametrize("name, path", [
    ("phi-3.gguf", lambda tmp: PHI3),
    ("phi-3.gguf (no space prefix)",
     lambda tmp: without_space_prefix(PHI3, os.path.join(tmp, "variant.gguf"))),
    ("SmolLM2-135M-Instruct.Q4_1.gguf", lambda tmp: default_model_path()),
])
def test_corpus_ids_equal_llama_cpp(tmp_path, name, path) -> None:
    # English, German, Japanese, code, emoji, whitespace runs; BOS as the file asks
    tokenizer = load_tokenizer(path(str(tmp_path)))
    for text, expected in zip(read_corpus(), llama_cpp_ids(name), strict=True):
        assert tokenizer.encode(text) == expected, text


def test_llama_cpp_test_vectors_for_phi3() -> None:
    tokenizer = load_tokenizer(PHI3)
    for text, expected in read_vectors(PHI3):
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text


def test_sentencepiece_special_tokens_and_decoding() -> None:
    tokenizer = load_tokenizer(PHI3)
    # </s>, <|endoftext|> and <|end|>: the file names only the second; a chat turn ends
    # with the third (llama.cpp stops on all three)
    assert tokenizer.eos_token_ids == frozenset({2, 32000, 32007})
    ids = tokenizer.encode("<|user|>\nHi there<|end|>\n<|assistant|>", add_special_tokens=False)
    assert ids[0] == tokenizer.backend.token_to_id("<|user|>")
    assert tokenizer.backend.token_to_id("<|end|>") in ids
    for text in read_corpus():  # text without special tokens decodes to itself
        ids = tokenizer.encode(text, add_special_tokens=False)
        if tokenizer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False):
            assert tokenizer.decode(ids) == text


def _served(path: str) -> bool:
    metadata = read_gguf_metadata(path)
    return supports_byte_level_bpe(metadata) or supports_sentencepiece(metadata)


LLAMA_CPP_FILES = sorted(p[:-len(".inp")] for p in glob.glob(
    os.path.join(LLAMA_CPP_VOCABS or "", "ggml-vocab-*.gguf.inp"))) if LLAMA_CPP_VOCABS else []


@pytest.mark.skipif(not LLAMA_CPP_VOCABS, reason="TOKENMILL_LLAMA_CPP_VOCABS (llama.cpp's "
                    "models/ folder of vocabulary-only files) is not set")
@pytest.mark.parametrize("path", LLAMA_CPP_FILES, ids=os.path.basename)
def test_llama_cpp_vocabulary_files(path) -> None:
    if not _served(path):
        pytest.skip(f"{os.path.basename(path)}: a vocabulary kind tokenmill does not serve")
    tokenizer = load_tokenizer(path)
    for text, expected in read_vectors(path):
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text
