"""Tool calling: what a chat request's ``tools`` and ``tool_choice`` ask of the engine, and
how the model's text becomes OpenAI ``tool_calls``.

``plan_tools`` decides, per request::

    tool_choice   prompt                 output constraint              text -> tool_calls
    none          no tools               (the request's own, if any)    none: the text is content
    auto          tools, by the template (the request's own, if any)    the model's format (below)
    required      tools, by the template a JSON array of calls          the array
    {function}    tools, by the template the function's parameters      the arguments

``required`` and a named function are constrained by the grammar, so the arguments
always validate against the function's ``parameters``; the array's calls read
``[{"name": ..., "parameters": {...}}, ...]`` (one call unless ``parallel_tool_calls``).
For ``auto``, the model writes calls in its own format, which ``--tool-call-parser``
names (``auto`` picks it from the chat template): ``hermes`` (Hermes, Qwen:
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, any number, text around
them) or ``llama3_json`` (Llama 3: the whole output is ``{"name": ..., "parameters":
...}``, optionally after ``<|python_tag|>``, several separated by ``;``).

Each choice's text goes through a ``CallStream``: ``feed`` takes the text of each new
delta and returns the content to show and the ``tool_calls`` deltas to send, in OpenAI's
streaming shape (the first delta of a call carries its index, id, type and name; later
ones more of its ``arguments``); ``finish`` flushes what it held back. A full response
is the same stream fed the whole text and merged (``parse``), so streamed and
non-streamed calls agree. Text that might start a call (a partial ``<tool_call>``) is
held back until it is known not to.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import StructuredOutput

PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parser_for_template(source: str | None) -> str:
    """The tool-call format a chat template teaches its model."""
    if source and (PYTHON_TAG in source or "ipython" in source) and "<tool_call>" not in source:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None = None  # for the chat template; None: no tools shown
    parser: str = "hermes"  # auto: the model's format
    function: str | None = None  # named: the function called
    constraint: StructuredOutput | None = None  # required and named: the calls' grammar

    def stream(self) -> CallStream | None:
        """A fresh parser for one choice's text; None when the text is plain content."""
        if self.mode == "named":
            assert self.function is not None
            return NamedCallStream(self.function)
        if self.mode == "required":
            return ArrayCallStream()
        if self.mode == "auto":
            return TaggedCallStream() if self.parser == "hermes" else JsonCallStream()
        return None


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict | None,
               parallel_tool_calls: bool | None, template_supports_tools: bool,
               parser: str) -> ToolPlan:
    """The plan for a request's ``tools`` (OpenAI tool objects) and ``tool_choice``
    (a mode, or ``{"type": "function", "function": {"name": ...}}``); ``parser`` is the
    server's ``--tool-call-parser`` resolved for the model. Raises
    ``InvalidParameterError`` naming ``tools`` or ``tool_choice``."""
    tools = tools or []
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice != "none" and not tools:
        raise InvalidParameterError("tool_choice needs tools", "tool_choice")
    if tool_choice == "none":
        return ToolPlan("none")
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if len(functions) < len(tools):
        raise InvalidParameterError("tool names must be unique", "tools")
    parameters = {name: _parameters(name, f.get("parameters")) for name, f in functions.items()}
    if tool_choice == "auto":
        if not template_supports_tools:
            raise InvalidParameterError(
                "this model's chat template does not render tools, so tool_choice 'auto' "
                "cannot work; use tool_choice 'required' or a named function (the grammar "
                "then writes the call), or a model whose template supports tools",
                "tool_choice")
        return ToolPlan("auto", tools, parser)
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in parameters.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if parallel_tool_calls is False:
            array["maxItems"] = 1
        return ToolPlan("required", tools, constraint=StructuredOutput("json", json.dumps(array)))
    assert isinstance(tool_choice, dict)
    name = tool_choice["function"]["name"]
    if name not in functions:
        raise InvalidParameterError(f"tool_choice names the function {name!r}, which is not "
                                    "among the tools", "tool_choice")
    return ToolPlan("named", tools, function=name,
                    constraint=StructuredOutput("json", json.dumps(parameters[name])))


def _parameters(name: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    """A function's ``parameters`` schema, of a JSON object (OpenAI's rule: one that does
    not say its type is an object's); none given, any object."""
    if schema is None:
        return {"type": "object"}
    kind = schema.get("type", "object")
    if kind != "object":
        raise InvalidParameterError(f"the parameters of function {name!r} must be a JSON "
                                    f"schema of type object, not {kind!r}", "tools")
    return {"type": "object", **schema}


# ------------------------------------------------------------------ parsing the text


class CallStream:
    """Text in, (content, tool_calls deltas) out; see the module docstring."""

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict]]:
        return "", []

    def _whole_call(self, name: str, arguments: str) -> dict:
        delta = {"index": self.num_calls, "id": new_call_id(), "type": "function",
                 "function": {"name": name, "arguments": arguments}}
        self.num_calls += 1
        return delta


def parse(stream: CallStream, text: str) -> tuple[str, list[dict]]:
    """The whole ``text`` through ``stream``: (content, tool calls in OpenAI's message
    shape, each with id, type and function name and arguments)."""
    content, deltas = stream.feed(text)
    more_content, more = stream.finish()
    calls: list[dict] = []
    for delta in deltas + more:
        if delta["index"] == len(calls):
            calls.append({"id": delta["id"], "type": "function",
                          "function": {"name": delta["function"]["name"], "arguments": ""}})
        calls[delta["index"]]["function"]["arguments"] += delta["function"].get("arguments", "")
    return content + more_content, calls


class NamedCallStream(CallStream):
    """tool_choice naming a function: the whole text is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.num_calls == 0:
            return "", [self._whole_call(self.name, text)]
        return "", [{"index": 0, "function": {"arguments": text}}]

    def finish(self) -> tuple[str, list[dict]]:
        return ("", [self._whole_call(self.name, "")]) if self.num_calls == 0 else ("", [])


class ArrayCallStream(CallStream):
    """tool_choice ``required``: a JSON array of ``{"name": ..., "parameters": {...}}``
    (the grammar's), scanned as it arrives; each call's arguments are the raw text of
    its ``parameters`` value, streamed as it grows."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.string_start = 0
        self.expect_key = False
        self.key: str | None = None
        # per call: [name, args start, args end, chars of arguments sent, announced]
        self.calls: list[list] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        for i in range(self.pos, len(self.text)):
            self._step(i, self.text[i])
        self.pos = len(self.text)
        return "", self._deltas()

    def _step(self, i: int, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 2:
                    value = json.loads(self.text[self.string_start:i + 1])
                    if self.expect_key:
                        self.key, self.expect_key = value, False
                    elif self.key == "name" and self.calls:
                        self.calls[-1][0] = value
            return
        if c == '"':
            self.in_string, self.string_start = True, i
        elif c in "{[":
            if self.depth == 2 and self.key == "parameters" and self.calls[-1][1] is None:
                self.calls[-1][1] = i
            self.depth += 1
            if self.depth == 2:
                self.calls.append([None, None, None, 0, False])
                self.expect_key, self.key = True, None
        elif c in "}]":
            self.depth -= 1
            if self.depth == 2 and self.calls and self.calls[-1][1] is not None \
                    and self.calls[-1][2] is None:
                self.calls[-1][2] = i + 1
        elif c == "," and self.depth == 2:
            self.expect_key = True

    def _deltas(self) -> list[dict]:
        deltas = []
        for index, call in enumerate(self.calls):
            name, start, end, sent, announced = call
            if name is None:
                break
            arguments = "" if start is None else self.text[start:end if end else len(self.text)]
            if not announced:
                call[4] = True
                deltas.append(self._whole_call(name, arguments[sent:]))
            elif len(arguments) > sent:
                deltas.append({"index": index, "function": {"arguments": arguments[sent:]}})
            call[3] = len(arguments)
        return deltas


class TaggedCallStream(CallStream):
    """Hermes / Qwen: calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    among ordinary text. A block that is not a call stays in the content; whitespace
    between and after calls is dropped."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""
        self.in_call = False
        self.held_space = ""  # whitespace after a call, kept until text follows it

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content: list[str | None] = []  # None: a call was here
        deltas: list[dict] = []
        while True:
            if not self.in_call:
                k = self.pending.find(self.OPEN)
                if k < 0:
                    keep = _partial_suffix(self.pending, self.OPEN)
                    content.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content.append(self.pending[:k])
                self.pending, self.in_call = self.pending[k + len(self.OPEN):], True
            else:
                k = self.pending.find(self.CLOSE)
                if k < 0:
                    break
                body, self.pending = self.pending[:k], self.pending[k + len(self.CLOSE):]
                self.in_call = False
                call = _call_object(body)
                if call is None:
                    content.append(self.OPEN + body + self.CLOSE)
                else:
                    content.append(None)
                    deltas.append(self._whole_call(*call))
        return self._visible(content), deltas

    def _visible(self, parts: list[str | None]) -> str:
        """Content to show: whitespace that follows a call waits until more text comes."""
        out = []
        for part in parts:
            if part is None:
                self.held_space = ""
                continue
            if self.num_calls and not part.strip():
                self.held_space += part
                continue
            out.append(self.held_space + part)
            self.held_space = ""
        return "".join(out)

    def finish(self) -> tuple[str, list[dict]]:
        pending, self.pending = self.pending, ""
        if not self.in_call:
            return self._visible([pending]), []
        call = _call_object(pending.removesuffix(self.CLOSE))
        if call is None:
            return self._visible([self.OPEN + pending]), []
        return "", [self._whole_call(*call)]


class JsonCallStream(CallStream):
    """Llama 3: an output that starts with ``{`` (or ``<|python_tag|>``) is held and read
    as calls separated by ``;`` once complete; any other output is content, as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self.held = ""
        self.mode: str | None = None  # None: not known yet; "content" or "calls"

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.mode == "content":
            return text, []
        self.held += text
        start = self.held.lstrip()
        if self.mode is None and start:
            if start.startswith(("{", PYTHON_TAG)):
                self.mode = "calls"
            elif not PYTHON_TAG.startswith(start):
                self.mode = "content"
                held, self.held = self.held, ""
                return held, []
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        held, self.held = self.held, ""
        calls = _json_calls(held.strip().removeprefix(PYTHON_TAG))
        if calls is None:
            return held, []
        return "", [self._whole_call(*call) for call in calls]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _call_object(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call object, or None when ``text`` is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return _name_and_arguments(value)


def _name_and_arguments(value: Any) -> tuple[str, str] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    """Calls written as JSON objects separated by ``;`` (or whitespace); None unless the
    whole text is such calls."""
    decoder = json.JSONDecoder()
    calls = []
    i = 0
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        call = _name_and_arguments(value)
        if call is None:
            return None
        calls.append(call)
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
    return calls or None
