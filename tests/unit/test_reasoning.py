"""The reasoning parsers: streamed splits equal whole ones, markers split across deltas,
prompts that open or close the reasoning, exact reasoning-token counts, and the grammar
that starts a structured output at the end of the reasoning."""

from __future__ import annotations

import llguidance
import pytest

from tokenmill.config import ServerConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import StructuredOutput
from tokenmill.server.formats import ChatFormat
from tokenmill.server.reasoning import ReasoningParser
from tokenmill.server.tools import plan_tools
from tokenmill.structured.grammar import check_structured_output, grammar_text

HARMONY = ("<|channel|>analysis<|message|>Think hard.<|end|><|start|>assistant"
           "<|channel|>final<|message|>The answer.<|return|>")


def streamed(parser: ReasoningParser, tail: str, pieces: list[str]) -> tuple[str, str]:
    stream = parser.stream(tail)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("name, tail, text, want", [
    ("deepseek_r1", "", "<think>a b</think>\n\nanswer", ("a b", "\n\nanswer")),
    ("deepseek_r1", "", "a b</think>answer", ("a b", "answer")),
    ("deepseek_r1", "", "no end at all", ("no end at all", "")),
    ("deepseek_r1", "<think>\n", "a</think>b", ("a", "b")),
    ("deepseek_r1", "<think>\n\n</think>\n\n", "just an answer", ("", "just an answer")),
    ("qwen3", "", "<think>\nhm</think>\n\nok", ("\nhm", "\n\nok")),
    ("qwen3", "", "plain answer, no thinking", ("", "plain answer, no thinking")),
    ("qwen3", "", "  <think>x", ("x", "")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "x</think>y", ("x", "y")),
    ("qwen3", "", "<thin", ("", "<thin")),
    ("openai_gptoss", "", HARMONY, ("Think hard.", "The answer.")),
    ("openai_gptoss", "", "<|channel|>analysis<|message|>cut off", ("cut off", "")),
    ("openai_gptoss", "", "no harmony here", ("", "no harmony here")),
])
def test_split_whole_and_streamed_agree(name, tail, text, want) -> None:
    parser = ReasoningParser(name)
    assert parser.split(tail, text) == want
    assert streamed(parser, tail, list(text)) == want  # one character per delta
    for cut in range(len(text) + 1):
        assert streamed(parser, tail, [text[:cut], text[cut:]]) == want


def test_markers_are_held_back_until_known() -> None:
    stream = ReasoningParser("deepseek_r1").stream("")
    assert stream.feed("abc</thi") == ("abc", "")
    assert stream.feed("nk>x") == ("", "x")
    stream = ReasoningParser("qwen3").stream("")
    assert stream.feed("<th") == ("", "")  # may still open the reasoning
    assert stream.feed("e end") == ("", "<the end")


class CharTokens:
    """A tokenizer with one token per character, and a few whole-marker tokens."""

    SPECIAL = ["<think>", "</think>", "<|channel|>", "<|message|>", "<|end|>", "<|start|>",
               "<|return|>"]

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for k, marker in enumerate(self.SPECIAL):
                if text.startswith(marker, i):
                    ids.append(1000 + k)
                    i += len(marker)
                    break
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def decode(self, ids) -> str:
        return "".join(self.SPECIAL[i - 1000] if i >= 1000 else chr(i) for i in ids)


@pytest.mark.parametrize("name, tail, text, want", [
    ("deepseek_r1", "", "<think>ab</think>cd", 4),  # <think> a b </think>
    ("deepseek_r1", "", "ab</think>cd", 3),
    ("deepseek_r1", "", "never ends", 10),
    ("deepseek_r1", "", "", 0),
    ("deepseek_r1", "</think>", "answer", 0),
    ("qwen3", "", "answer only", 0),
    ("qwen3", "", "<think>x</think>", 3),
    ("openai_gptoss", "", HARMONY, 1 + len("analysis") + 1 + len("Think hard.") + 1),
])
def test_reasoning_tokens_are_exact(name, tail, text, want) -> None:
    tokens = CharTokens()
    ids = tokens.encode(text)
    assert ReasoningParser(name).reasoning_tokens(tokens.decode, tail, ids) == want


def test_unknown_parser_and_gptoss_constraint_are_refused() -> None:
    with pytest.raises(InvalidParameterError):
        ReasoningParser("nope")
    with pytest.raises(InvalidParameterError):
        ServerConfig(reasoning_parser="nope")
    assert ServerConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(InvalidParameterError, match="openai_gptoss"):
        ReasoningParser("openai_gptoss").constraint(
            StructuredOutput("json", "{}"), "", "response_format")


def test_constraint_moves_to_the_end_of_the_reasoning() -> None:
    parser = ReasoningParser("qwen3")
    schema = StructuredOutput("json", '{"type": "object"}')
    assert parser.constraint(schema, "", "response_format").after == "</think>"
    assert parser.constraint(schema, "<think>\n\n</think>\n\n", "x") == schema  # closed
    assert parser.constraint(None, "", "x") is None


@pytest.mark.parametrize("constraint, good, bad", [
    (StructuredOutput("json", '{"type":"object","properties":{"a":{"type":"integer"}},'
                              '"required":["a"]}'), '{"a": 1}', '{"a": "x"}'),
    (StructuredOutput("regex", "yes|no"), "no", "maybe"),
    (StructuredOutput("choice", '["red", "blue"]'), "blue", "green"),
    (StructuredOutput("grammar", 'start: "x" "y"'), "xy", "yx"),
    (StructuredOutput("grammar", 'root ::= "x" "y"'), "xy", "yx"),
])
def test_grammar_after_the_reasoning(constraint, good, bad) -> None:
    after = StructuredOutput(constraint.kind, constraint.spec, after="</think>")
    check_structured_output(after)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(after), log_level=0)
        ok = all(matcher.consume_token(b) for b in text.encode())
        return ok and matcher.is_accepting()

    assert accepts("some <b>free</b> thinking {}</think>" + good)
    assert accepts("</think>\n\n" + good)
    assert not accepts("thinking</think>" + bad)
    assert not accepts("a</think>b</think>" + good)  # the reasoning ends at the first marker
    assert not accepts(good)  # nothing is constrained before the reasoning ends


class _ByteTokenizer:
    """One token per byte, for llguidance (plus an end-of-sequence token)."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text, **_):
        return list(text.encode() if isinstance(text, str) else text)


def test_chat_format_sends_reasoning_content_before_content_and_calls() -> None:
    parser = ReasoningParser("qwen3")
    plan = plan_tools([{"type": "function", "function": {"name": "f"}}], "auto", None, True,
                      "hermes")
    fmt = ChatFormat(None, plan, lambda: parser.stream(""))  # type: ignore[arg-type]
    texts = ["<think>a", "b</thi", "nk>\n\nc", '<tool_call>{"name": "f", "arguments": {}}',
             "</tool_call>"]
    deltas = [fmt.stream_choice(0, t, None, None, None, i == 0) for i, t in enumerate(texts)]
    last = fmt.stream_choice(0, "", None, "stop", None, False)
    assert [d["delta"].get("reasoning_content") for d in deltas[:2]] == ["a", "b"]
    assert deltas[2]["delta"]["content"] == "\n\nc"
    assert deltas[3] is None  # the call is being written
    assert deltas[4]["delta"]["tool_calls"][0]["function"]["name"] == "f"
    assert last["finish_reason"] == "tool_calls"
    full = ChatFormat(None, plan, lambda: parser.stream("")).full_choice(  # type: ignore[arg-type]
        0, "".join(texts), None, "stop", None)
    message = full["message"]
    assert message["reasoning_content"] == "ab" and message["content"] == "\n\nc"
    assert message["tool_calls"][0]["function"]["name"] == "f"
