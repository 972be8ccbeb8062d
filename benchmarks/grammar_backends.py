"""Compare the two grammar engines tokenmill could use, on this CPU: llguidance and xgrammar.

For each of a few JSON schemas (and a regex), on the embedded SmolLM2's vocabulary
(49,152 tokens): the time to compile the schema for the vocabulary (uncached), and the
time to compute the next-token bitmask at each token of one fixed, schema-valid output
(the same token path for both engines), then consume the token.

    python benchmarks/grammar_backends.py

xgrammar is not a tokenmill dependency (it imports torch and transformers, so it could
not validate grammars on the torch-free HTTP side): install it to run its half
(``pip install xgrammar``); without it only llguidance's figures are printed.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from tokenmill.tokenizer.tokenizer import load_tokenizer

VOCAB_SIZE = 49152
CASES = [
    ("flat object", {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36, "ok": True}),
    ("nested + arrays", {"type": "object", "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "author": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
            "required": ["name", "email"]},
        "scores": {"type": "array", "items": {"type": "number"}}},
        "required": ["title", "tags", "author", "scores"]},
     {"title": "A tale of two caches", "tags": ["kv", "paged", "prefix"],
      "author": {"name": "Grace", "email": "grace@example.com"}, "scores": [0.5, 12.25, -3]}),
    ("enums + bounds", {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 100},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
        "required": ["colour", "count", "code"]},
     {"colour": "green", "count": 42, "code": "ABC-1234"}),
    ("anyOf + $defs", {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}},
        "type": "object", "properties": {"shape": {"anyOf": [
            {"type": "object", "properties": {"circle": {"$ref": "#/$defs/point"},
                                              "r": {"type": "number"}},
             "required": ["circle", "r"]},
            {"type": "object", "properties": {"polygon": {
                "type": "array", "items": {"$ref": "#/$defs/point"}}},
             "required": ["polygon"]}]}}, "required": ["shape"]},
     {"shape": {"polygon": [{"x": 0, "y": 0}, {"x": 1, "y": 0}, {"x": 0, "y": 1}]}}),
]


def _path(tokenizer, instance) -> list[int]:
    return tokenizer.encode(json.dumps(instance, separators=(",", ":")),
                            add_special_tokens=False)


def bench_llguidance(tokenizer) -> dict:
    import llguidance
    import llguidance.numpy

    start = time.perf_counter()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=VOCAB_SIZE,
                                          eos_token=sorted(tokenizer.eos_token_ids))
    setup = time.perf_counter() - start
    results = {}
    for name, schema, instance in CASES:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        compile_s = time.perf_counter() - start
        assert not matcher.is_error(), matcher.get_error()
        mask = llguidance.numpy.allocate_token_bitmask(1, VOCAB_SIZE)
        times = []
        for token in _path(tokenizer, instance):
            start = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, mask)
            times.append(time.perf_counter() - start)
            assert (mask[0, token // 32] >> (token % 32)) & 1, "the valid path is allowed"
            assert matcher.consume_token(token), matcher.get_error()
        # a second matcher for the same schema: what a cache of compiled grammars saves
        start = time.perf_counter()
        llguidance.LLMatcher(ll_tokenizer, grammar)
        again = time.perf_counter() - start
        results[name] = (compile_s, again, times)
    return {"setup": setup, "cases": results}


def bench_xgrammar(tokenizer) -> dict | None:
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    start = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token="<|im_end|>")
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB_SIZE)
    setup = time.perf_counter() - start
    results = {}
    for name, schema, instance in CASES:
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                               separators=(",", ":"))
        compile_s = time.perf_counter() - start
        matcher = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, VOCAB_SIZE)
        times = []
        for token in _path(tokenizer, instance):
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - start)
            assert (int(mask[0, token // 32]) >> (token % 32)) & 1, "the valid path is allowed"
            assert matcher.accept_token(token)
        start = time.perf_counter()
        xgrammar.GrammarMatcher(compiled)
        again = time.perf_counter() - start
        results[name] = (compile_s, again, times)
    return {"setup": setup, "cases": results}


def main() -> None:
    tokenizer = load_tokenizer(None)
    np.set_printoptions(precision=3)
    print(f"vocabulary: {VOCAB_SIZE} tokens (SmolLM2); times per schema, one thread")
    for engine, run in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        out = run(tokenizer)
        if out is None:
            print(f"\n{engine}: not installed")
            continue
        print(f"\n{engine}: tokenizer setup {out['setup'] * 1e3:.0f} ms")
        print(f"  {'schema':<16} {'compile ms':>10} {'again ms':>9} {'tokens':>6} "
              f"{'mask us p50':>11} {'mask us p90':>11} {'mask us max':>11}")
        for name, (compile_s, again, times) in out["cases"].items():
            us = sorted(t * 1e6 for t in times)
            print(f"  {name:<16} {compile_s * 1e3:>10.2f} {again * 1e3:>9.2f} {len(us):>6} "
                  f"{statistics.median(us):>11.1f} {us[int(0.9 * (len(us) - 1))]:>11.1f} "
                  f"{us[-1]:>11.1f}")


if __name__ == "__main__":
    main()
