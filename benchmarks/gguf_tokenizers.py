"""Token ids from tokenmill's GGUF tokenizers against llama.cpp's, for the same files.

For each GGUF file, every case of the corpus (``tests/data/vocab/corpus.txt`` unless
``--corpus``; cases separated by ``CASE_SEPARATOR`` lines) is tokenized by tokenmill
(``load_tokenizer(path).encode(text)``: special tokens added as the file asks, added
tokens matched) and by llama.cpp's ``llama-tokenize`` (its defaults: the same), and the
ids are compared. ``--no-space-prefix`` adds, for each SentencePiece file, a copy with
``tokenizer.ggml.add_space_prefix = false`` (as Gemma files say). Prints a table (file,
vocabulary kind, pre-tokenizer, cases equal, tokenizer load time) and writes JSON with
llama.cpp's ids per file and case, the test suite's expected ids. Usage::

    python benchmarks/gguf_tokenizers.py --llama-tokenize PATH [--corpus FILE]
        [--no-space-prefix] [--out FILE] GGUF [GGUF ...]
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import time

from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table

from tokenmill.tokenizer.gguf_vocab import read_gguf_metadata
from tokenmill.tokenizer.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from vocab_files import CASE_SEPARATOR, read_corpus, without_space_prefix  # noqa: E402


def llama_cpp_ids(llama_tokenize: str, path: str, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt") as f:
        f.write(text)
        f.flush()
        result = subprocess.run([llama_tokenize, "-m", path, "-f", f.name, "--ids",
                                 "--log-disable"], capture_output=True, text=True, check=True)
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


def compare(llama_tokenize: str, path: str, name: str, cases: list[str]) -> dict:
    start = time.perf_counter()
    tokenizer = load_tokenizer(path)
    load_s = time.perf_counter() - start
    expected = [llama_cpp_ids(llama_tokenize, path, text) for text in cases]
    equal = sum(tokenizer.encode(text) == ids for text, ids in zip(cases, expected, strict=True))
    metadata = read_gguf_metadata(path)
    return {"file": name, "model": metadata.get("tokenizer.ggml.model"),
            "pre": metadata.get("tokenizer.ggml.pre", "-"), "cases": len(cases),
            "equal": equal, "load_s": load_s, "llama_cpp_ids": expected}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-tokenize", required=True)
    parser.add_argument("--corpus", default=os.path.join(ROOT, "tests", "data", "vocab",
                                                         "corpus.txt"))
    parser.add_argument("--no-space-prefix", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/gguf_tokenizers.json")
    parser.add_argument("gguf", nargs="+")
    args = parser.parse_args()
    cases = read_corpus(args.corpus)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for path in args.gguf:
            name = os.path.basename(path)
            results.append(compare(args.llama_tokenize, path, name, cases))
            if args.no_space_prefix and read_gguf_metadata(path).get(
                    "tokenizer.ggml.model") == "llama":
                variant = without_space_prefix(path, os.path.join(scratch, f"no-prefix-{name}"))
                results.append(compare(args.llama_tokenize, variant,
                                       f"{name} (no space prefix)", cases))
    table = Table(title=f"tokenmill vs llama.cpp token ids, {len(cases)} cases "
                        f"(separator {CASE_SEPARATOR!r})")
    for column in ("file", "vocabulary", "pre-tokenizer", "cases equal", "load s"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r["file"], r["model"], r["pre"], f"{r['equal']}/{r['cases']}",
                      f"{r['load_s']:.2f}")
    Console(width=120).print(table)
    write_report({"corpus": os.path.relpath(args.corpus, ROOT), "results": results}, args.out)


if __name__ == "__main__":
    main()
