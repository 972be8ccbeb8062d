"""Reasoning models' thinking, split from their answer (``--reasoning-parser``).

Parsers, named as vLLM names them::

    deepseek_r1     <think> reasoning </think> answer; the output is reasoning from its
                    first token (a leading <think> is dropped) until </think>
    qwen3           the same markers; the output is reasoning only when it begins with
                    <think> (or the prompt opened it), else it is all answer
    openai_gptoss   gpt-oss's harmony messages: the ``analysis`` channel is the reasoning,
                    every other channel the answer (special tokens are kept in the text
                    for this, and dropped from what is shown)

A prompt that already ends inside the reasoning (its generation prompt ends with
``<think>``) starts the output as reasoning; one that ends after it (``</think>``, as
Qwen3's template writes when thinking is off) starts it as answer.

Each choice's text goes through a ``ReasoningStream``: ``feed`` takes the text of each new
delta and returns (reasoning, content), holding back text that may be the start of a
marker; ``finish`` flushes it. A full response is the same stream fed the whole text, so
streamed and non-streamed splits agree.

Reasoning tokens (``reasoning_tokens``) are the output tokens up to and including the one
that completes the marker closing the reasoning (``</think>``; the ``<|end|>`` of the
last analysis message); all of them when the reasoning never closes; none when there was
no reasoning. They are counted from the choice's token ids, with the tokenizer, once the
choice is done, so the count does not depend on how the tokens were batched into deltas.

A structured output (``StructuredOutput.after``) applies from the end of the reasoning,
as vLLM's does: the grammar lets free text through up to the first ``</think>``. With
``openai_gptoss``, whose reasoning ends at special tokens, a constraint is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import StructuredOutput

THINK_START, THINK_END = "<think>", "</think>"
HARMONY_END_MARKERS = ("<|end|>", "<|return|>", "<|call|>")
HARMONY_MESSAGE = "<|message|>"
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers``."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class ReasoningStream:
    """Text in, (reasoning, content) out; see the module docstring. ``num_closed`` counts
    the reasoning segments closed so far; ``open`` says whether one is open now."""

    def __init__(self) -> None:
        self.num_closed = 0
        self.open = False

    def feed(self, text: str) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        raise NotImplementedError


class ThinkStream(ReasoningStream):
    """``<think>`` ... ``</think>``: see the module docstring."""

    LEAD, REASONING, CONTENT = "lead", "reasoning", "content"

    def __init__(self, state: str, after_lead: str) -> None:
        super().__init__()
        self.state = state  # lead: the output may still open with <think>
        self.after_lead = after_lead  # where a lead without <think> goes
        self.pending = ""
        # the output is reasoning from its first token where the lead falls into it
        self.open = self.REASONING in (state, after_lead)

    def _enter(self, state: str) -> None:
        self.state = state
        if state == self.REASONING:
            self.open = True

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.state == self.LEAD:
                start = self.pending.lstrip()
                if start.startswith(THINK_START):
                    self.pending = start[len(THINK_START):]
                    self._enter(self.REASONING)
                elif THINK_START.startswith(start):
                    break  # may still be <think>
                else:
                    self._enter(self.after_lead)
            elif self.state == self.REASONING:
                k = self.pending.find(THINK_END)
                if k >= 0:
                    reasoning.append(self.pending[:k])
                    self.pending = self.pending[k + len(THINK_END):]
                    self.state, self.open = self.CONTENT, False
                    self.num_closed += 1
                    continue
                keep = _partial_suffix(self.pending, (THINK_END,))
                reasoning.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            else:
                content.append(self.pending)
                self.pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        if self.state == self.LEAD and self.pending:
            self._enter(self.after_lead)
        pending, self.pending = self.pending, ""
        return (pending, "") if self.state == self.REASONING else ("", pending)


class HarmonyStream(ReasoningStream):
    """gpt-oss: ``[<|start|>assistant]<|channel|>NAME<|message|>TEXT<|end|>`` messages; the
    generation prompt ends with ``<|start|>assistant``, so the output opens in a header."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""
        self.channel: str | None = None  # None: in a header

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.channel is None:
                k = self.pending.find(HARMONY_MESSAGE)
                if k < 0:
                    break
                found = _HARMONY_CHANNEL.search(self.pending[:k])
                self.channel = found.group(1) if found else "final"
                self.pending = self.pending[k + len(HARMONY_MESSAGE):]
                if self.channel == "analysis":
                    self.open = True
                continue
            ends = [(k, m) for m in HARMONY_END_MARKERS if (k := self.pending.find(m)) >= 0]
            out = reasoning if self.channel == "analysis" else content
            if ends:
                k, marker = min(ends)
                out.append(self.pending[:k])
                self.pending = self.pending[k + len(marker):]
                if self.channel == "analysis":
                    self.num_closed += 1
                    self.open = False
                self.channel = None
                continue
            keep = _partial_suffix(self.pending, HARMONY_END_MARKERS)
            out.append(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        pending, self.pending = self.pending, ""
        if self.channel == "analysis":
            return pending, ""
        if self.channel is None and (self.num_closed or "<|" in pending):
            return "", ""  # an unfinished header
        return "", pending  # an answer, or text that is no harmony at all


class ReasoningParser:
    """One ``--reasoning-parser``: per-choice streams, the reasoning-token count, and the
    structured-output constraint moved to the end of the reasoning."""

    def __init__(self, name: str) -> None:
        if name not in ("deepseek_r1", "qwen3", "openai_gptoss"):
            raise InvalidParameterError(f"unknown reasoning parser {name!r}", "reasoning_parser")
        self.name = name
        # gpt-oss's channels are special tokens: they must reach the text to be read
        self.skip_special_tokens = name != "openai_gptoss"

    def stream(self, prompt_tail: str) -> ReasoningStream:
        """A fresh stream for one choice of a prompt that ends with ``prompt_tail``."""
        if self.name == "openai_gptoss":
            return HarmonyStream()
        tail = prompt_tail.rstrip()
        if tail.endswith(THINK_END):
            return ThinkStream(ThinkStream.CONTENT, ThinkStream.CONTENT)
        if tail.endswith(THINK_START):
            return ThinkStream(ThinkStream.LEAD, ThinkStream.REASONING)
        default = ThinkStream.REASONING if self.name == "deepseek_r1" else ThinkStream.CONTENT
        return ThinkStream(ThinkStream.LEAD, default)

    def split(self, prompt_tail: str, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        stream = self.stream(prompt_tail)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return reasoning + more_reasoning, content + more_content

    def reasoning_tokens(self, decode: Callable[[Sequence[int]], str], prompt_tail: str,
                         output_ids: Sequence[int]) -> int:
        """How many of ``output_ids`` are reasoning (see the module docstring); ``decode``
        turns token ids into text as the choice's detokeniser does."""
        whole = self._state(prompt_tail, decode(output_ids))
        if whole.open:
            return len(output_ids)
        if not whole.num_closed:
            return 0
        low, high = 1, len(output_ids)  # the fewest tokens that close every segment
        while low < high:
            mid = (low + high) // 2
            if self._state(prompt_tail, decode(output_ids[:mid])).num_closed < whole.num_closed:
                low = mid + 1
            else:
                high = mid
        return low

    def _state(self, prompt_tail: str, text: str) -> ReasoningStream:
        stream = self.stream(prompt_tail)
        stream.feed(text)
        stream.finish()
        return stream

    def constraint(self, constraint: StructuredOutput | None, prompt_tail: str,
                   param: str) -> StructuredOutput | None:
        """``constraint`` applied from the end of the reasoning (none to wait for when the
        prompt has closed it already)."""
        if constraint is None:
            return None
        if self.name == "openai_gptoss":
            raise InvalidParameterError(
                f"{param}: a structured output cannot be combined with the reasoning parser "
                "openai_gptoss on this server", param)
        if prompt_tail.rstrip().endswith(THINK_END):
            return constraint
        return replace(constraint, after=THINK_END)
