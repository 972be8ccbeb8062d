"""From a ``StructuredOutput`` to the grammar llguidance compiles, and the check that a
constraint compiles, run where requests arrive (torch-free).

The JSON schema, regex and grammar compilers are llguidance's own; this module only
picks the options: JSON whitespace (``DEFAULT_JSON_WHITESPACE`` unless the request says),
and a choice list as a grammar of literal alternatives.

A constraint that applies after a reasoning model's reasoning (``after``) is the same
grammar behind one lexeme: any text that ends with the first ``after`` marker (and up to
two line breaks), so the matcher lets the reasoning through and constrains what follows.
"""

from __future__ import annotations

import functools
import json
import re

import llguidance

from tokenmill.sampling_params import StructuredOutput

# At most one space, or one line break and an indent of up to 20: compact JSON, JSON with
# a space after ':' and ',', and pretty-printed JSON all pass, while no run of whitespace
# can go on forever (a small model may otherwise spend its whole budget on spaces).
DEFAULT_JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"


class GrammarError(ValueError):
    """The constraint does not compile; the message says why."""


def grammar_text(constraint: StructuredOutput) -> str:
    """llguidance's grammar for ``constraint``; ``GrammarError`` when it cannot be built
    (whether it compiles is ``check_structured_output``'s question)."""
    grammar = _own_grammar(constraint)
    return grammar if constraint.after is None else _after_marker(grammar, constraint.after)


def _after_marker(grammar: str, marker: str) -> str:
    """``grammar`` (llguidance's top-level JSON, or Lark text) preceded by free text up to
    and including the first ``marker``."""
    top = json.loads(grammar) if grammar.startswith("{") else {
        "grammars": [{"lark_grammar": grammar}]}
    first = top["grammars"][0]
    first["name"] = name = first.get("name") or "constraint"
    m = re.escape(marker).replace("/", "\\/")
    lark = (f"start: REASONING @{name}\n"
            f"REASONING: /(?s:.*){m}\\n{{0,2}}/ & ~/(?s:.*{m}.*{m}.*)/\n")
    top["grammars"].insert(0, {"lark_grammar": lark})
    return json.dumps(top)


def _own_grammar(constraint: StructuredOutput) -> str:
    kind, spec = constraint.kind, constraint.spec
    if kind == "json":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if schema is True:
            schema = {}  # any JSON value
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object, or true")
        if constraint.whitespace == "":
            options: dict = {"whitespace_flexible": False}
        else:
            options = {"whitespace_pattern": constraint.whitespace or DEFAULT_JSON_WHITESPACE}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise GrammarError(str(e)) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError:
            choices = None
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise GrammarError("choices must be a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    try:
        return llguidance.grammar_from("grammar", spec)
    except Exception as e:  # noqa: BLE001 - the GBNF converter raises plain Exceptions
        raise GrammarError(str(e).removeprefix("Failed to convert the grammar from GBNF to "
                                               "Lark: ")) from None


def check_structured_output(constraint: StructuredOutput) -> None:
    """Raise ``GrammarError`` unless ``constraint`` compiles. Results are cached, so a
    schema sent again costs a dictionary lookup; the first check of a large grammar may
    take milliseconds (run it off an event loop)."""
    error = _compile_error(constraint)
    if error:
        raise GrammarError(error)


@functools.lru_cache(maxsize=256)
def _compile_error(constraint: StructuredOutput) -> str:
    try:
        grammar = grammar_text(constraint)
    except GrammarError as e:
        return str(e)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return _first_lines(messages[0]) if failed else ""


def _first_lines(message: str, limit: int = 400) -> str:
    """llguidance's message without its trailing source excerpt, at most ``limit`` chars."""
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + "..."
