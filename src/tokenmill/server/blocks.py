"""A chat choice's output as a list of blocks (reasoning, text, tool calls), built from its
chat chunk deltas: what the Responses API calls output items and Anthropic's Messages
API content blocks.

``BlockAssembler.feed`` takes one chunk's ``delta`` (``ChatFormat.stream_choice``: its
``reasoning_content``, ``content`` and ``tool_calls``) and returns what happened to the
blocks, in order: ``start`` (a new block), ``delta`` (more of its text or arguments),
``stop`` (it is complete). At most one block is open at a time; a block of another kind
(or another tool call) closes it. Whitespace-only text is held back until text that is
not whitespace follows it in the same block, so that the spaces a model writes between
its reasoning and a tool call open no empty text block (whitespace-only text that nothing
follows is dropped). A streamed response and a full
one are the same feed, so they always agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    kind: str  # "reasoning", "text" or "tool_call"
    index: int  # among the choice's blocks
    text: str = ""  # reasoning or text; a tool call's arguments (JSON text)
    call_id: str | None = None  # tool calls
    name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockEvent:
    type: str  # "start", "delta" or "stop"
    block: Block
    text: str = ""  # a delta's new text


class BlockAssembler:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._call_blocks: dict[int, Block] = {}  # by the chat delta's tool-call index
        self._held_space = ""  # whitespace not yet given to a text block

    def feed(self, delta: dict) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if delta.get("reasoning_content"):
            self._add(events, "reasoning", delta["reasoning_content"])
        content = self._held_space + (delta.get("content") or "")
        self._held_space = ""
        if content.strip() or (content and self._open is not None
                               and self._open.kind == "text"):
            self._add(events, "text", content)
        else:
            self._held_space = content
        for call in delta.get("tool_calls") or ():
            block = self._call_blocks.get(call["index"])
            if block is None:
                block = Block("tool_call", len(self.blocks), call_id=call["id"],
                              name=call["function"]["name"])
                self._call_blocks[call["index"]] = block
                self._switch(events, block)
            arguments = call["function"].get("arguments") or ""
            if arguments:
                block.text += arguments
                events.append(BlockEvent("delta", block, arguments))
        return events

    def finish(self) -> list[BlockEvent]:
        """Close the open block (at the choice's end); an output with no block at all gets
        one empty text block."""
        events: list[BlockEvent] = []
        if not self.blocks:
            self._switch(events, Block("text", 0))
        self._close(events)
        return events

    def _add(self, events: list[BlockEvent], kind: str, text: str) -> None:
        if self._open is None or self._open.kind != kind:
            self._switch(events, Block(kind, len(self.blocks)))
        assert self._open is not None
        self._open.text += text
        events.append(BlockEvent("delta", self._open, text))

    def _switch(self, events: list[BlockEvent], block: Block) -> None:
        self._close(events)
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent("start", block))

    def _close(self, events: list[BlockEvent]) -> None:
        if self._open is not None:
            events.append(BlockEvent("stop", self._open))
            self._open = None
