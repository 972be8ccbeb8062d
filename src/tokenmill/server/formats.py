"""How a choice's delta is spelled in each endpoint's JSON (completions vs chat).

A chat request with tools reads each choice's text through the plan's ``CallStream``
(``server/tools.py``): the chunks carry ``delta.tool_calls`` where the text held calls,
and a delta whose text is all held back (a call still being written) gives no chunk;
its logprobs go out with the next chunk of that choice.

With a reasoning parser (``server/reasoning.py``), each choice's text first goes through
its ``ReasoningStream``: the reasoning goes out as ``reasoning_content`` (in the message,
or in the deltas), and only the rest reaches the tool-call parser and ``content``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenmill.core.types import TokenLogprob
from tokenmill.server.reasoning import ReasoningStream
from tokenmill.server.tools import CallStream, ToolPlan, parse
from tokenmill.tokenizer.tokenizer import Tokenizer

# JSON has no -Infinity: a token a grammar forbids (probability 0) reports this, as vLLM does
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class CompletionFormat:
    object_stream = "text_completion"
    object_full = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text, as OpenAI reports it (special tokens included)."""
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def stream_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None,
                      finish_reason: str | None, stop_reason, first: bool) -> dict:
        return {"index": index, "text": text, "logprobs": self.logprobs(logprobs),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def full_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None,
                    finish_reason: str | None, stop_reason) -> dict:
        return self.stream_choice(index, text, logprobs, finish_reason, stop_reason, True)

    def logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        tokens = self.token_texts([e.token_id for e in entries])
        tops = []
        for entry in entries:
            names = self.token_texts([t for t, _ in entry.top])
            tops.append({name: _finite(lp)
                         for name, (_, lp) in zip(names, entry.top, strict=True)})
        return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": tops, "text_offset": []}


class ChatFormat(CompletionFormat):
    object_stream = "chat.completion.chunk"
    object_full = "chat.completion"
    id_prefix = "chatcmpl-"

    def __init__(self, tokenizer: Tokenizer, tools: ToolPlan | None = None,
                 reasoning: Callable[[], ReasoningStream] | None = None) -> None:
        """``reasoning`` makes a choice's reasoning stream; None: no reasoning parser."""
        super().__init__(tokenizer)
        self.tools = tools
        self.reasoning = reasoning
        self._reasoning_streams: dict[int, ReasoningStream] = {}  # by choice index
        self._streams: dict[int, CallStream] = {}  # by choice index
        self._called: set[int] = set()  # choices whose text held tool calls
        self._held_logprobs: dict[int, list[TokenLogprob]] = {}

    def stream_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None,
                      finish_reason: str | None, stop_reason, first: bool) -> dict | None:
        reasoning, text = self._split(index, text, finish_reason is not None)
        stream = self._stream(index)
        if stream is None:
            delta: dict = {"role": "assistant"} if first else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text or not reasoning:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs),
                    "finish_reason": finish_reason, "stop_reason": stop_reason}
        content, calls = stream.feed(text)
        if finish_reason is not None:
            more_content, more_calls = stream.finish()
            content, calls = content + more_content, calls + more_calls
        held = self._held_logprobs.setdefault(index, [])
        held.extend(logprobs or ())
        if not content and not calls and not reasoning and finish_reason is None:
            return None  # all held back: no chunk yet
        if calls:
            self._called.add(index)
        delta = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content or (first and not calls and not reasoning):
            delta["content"] = content
        elif first:
            delta["content"] = None
        if calls:
            delta["tool_calls"] = calls
        entries = None if logprobs is None and not held else list(held)
        held.clear()
        return {"index": index, "delta": delta, "logprobs": self.logprobs(entries),
                "finish_reason": self._finish_reason(index, finish_reason),
                "stop_reason": stop_reason}

    def full_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None,
                    finish_reason: str | None, stop_reason) -> dict:
        reasoning, text = self._split(index, text, True)
        message: dict = {"role": "assistant", "content": text}
        stream = self.tools.stream() if self.tools is not None else None
        if stream is not None:
            content, calls = parse(stream, text)
            if calls:
                self._called.add(index)
                message = {"role": "assistant", "content": content if content.strip() else None,
                           "tool_calls": calls}
            else:
                message["content"] = content
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
            if reasoning and not message["content"]:
                message["content"] = None
        return {"index": index, "message": message, "logprobs": self.logprobs(logprobs),
                "finish_reason": self._finish_reason(index, finish_reason),
                "stop_reason": stop_reason}

    def _split(self, index: int, text: str, last: bool) -> tuple[str, str]:
        """(reasoning, the rest) of choice ``index``'s new ``text``; ``last``: its end."""
        if self.reasoning is None:
            return "", text
        stream = self._reasoning_streams.get(index)
        if stream is None:
            stream = self._reasoning_streams[index] = self.reasoning()
        reasoning, content = stream.feed(text)
        if last:
            more_reasoning, more_content = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _stream(self, index: int) -> CallStream | None:
        if self.tools is None:
            return None
        if index not in self._streams:
            stream = self.tools.stream()
            if stream is None:
                return None
            self._streams[index] = stream
        return self._streams[index]

    def _finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        """``stop`` reads ``tool_calls`` for a choice that called tools (as OpenAI's)."""
        return "tool_calls" if finish_reason == "stop" and index in self._called else finish_reason

    def logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        content = []
        for entry in entries:
            [token] = self.token_texts([entry.token_id])
            names = self.token_texts([t for t, _ in entry.top])
            content.append({
                "token": token, "logprob": _finite(entry.logprob), "bytes": list(token.encode()),
                "top_logprobs": [{"token": name, "logprob": _finite(lp),
                                  "bytes": list(name.encode())}
                                 for name, (_, lp) in zip(names, entry.top, strict=True)],
            })
        return {"content": content}
