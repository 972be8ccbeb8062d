"""Structured outputs: a request's output constrained by a JSON schema, a regex, a list of
choices or a grammar, enforced token by token with llguidance.

- ``grammar``: a ``StructuredOutput`` (sampling_params.py) -> llguidance's grammar text,
  and ``check_structured_output``, which the HTTP side runs before a request reaches the
  engine (a bad schema, regex or grammar is a 400 there);
- ``compiler``: the engine's ``GrammarCompiler``: grammars compiled for the model's
  vocabulary on background threads, cached by ``StructuredOutput``;
- ``matcher``: ``RequestGrammar``, one request's matcher (its state follows the request's
  output tokens), and ``fill_bitmasks``, the allowed-token bitmasks of a step's rows.

Why llguidance (measured by ``benchmarks/grammar_backends.py``): it imports no torch, so
the torch-free HTTP side validates with the same engine the model's process enforces
with; it compiles a JSON schema in under a millisecond, so an uncached schema adds little
to a request's first token; and its next-token mask costs tens of microseconds per row.
Torch-free itself (numpy and llguidance only), this package sits beside the core.
"""
