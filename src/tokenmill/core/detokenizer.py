"""Turn a request's generated tokens into text deltas, one step at a time.

Two places run it over the same tokens: the frontend, for the text the client sees, and
the engine core, to stop a request on the token that completes a stop string
(``Scheduler.check_stop``). Both decode with the same tokenizer (the engine's is built
from the ``Vocabulary`` it was sent), so both find a stop string at the same token.

Decoding one token alone is wrong in two ways: a byte-level token may hold only part of
a UTF-8 character, and a SentencePiece token's leading space depends on what precedes
it. So text is decoded over a small window of tokens, with two offsets (as in vLLM and
mini-sglang)::

    window:  | context tokens (already returned) | unread tokens |
             0                                  read            len(window)

    context_text = decode(window[:read])          (cached)
    full_text    = decode(window)
    delta        = full_text[len(context_text):]  once full_text does not end in U+FFFD

When a delta is taken the window drops its context and the unread tokens become the
new context. The window starts with the last few prompt tokens, so the first output
token is decoded in context too. Per token this costs one decode of a window a few
tokens long (two when a delta is taken), never a re-decode of the whole output.

Invariants:
- a delta never ends in a partial UTF-8 character; a token that completes no character
  returns "" and its bytes arrive with a later token. A U+FFFD appears only for bytes
  that later tokens proved invalid; bytes still incomplete when the request ends are
  dropped, as in vLLM.
- ``output_text`` = everything returned so far + text held back for a possible stop
  string; after a stop it is cut at the stop string (or just after it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenmill.core.stop import StopStrings

PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Per-request incremental decoding with stop-string handling.

    ``add_tokens`` returns the new text; once a stop string is seen, ``stopped`` and
    ``stop_reason`` (the matched string) are set and later calls return "". When the
    request finishes for another reason, ``flush()`` returns the held-back text.
    """

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = StopStrings(stop, include_stop_str_in_output)
        self._window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._context_text = self._decode(self._window)
        self._text = ""
        self._num_returned = 0  # chars of _text already returned
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        return self._text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_next(self, token_id: int) -> str:
        """Text completed by ``token_id`` ("" while a character is still incomplete)."""
        self._window.append(token_id)
        full_text = self._decode(self._window)
        if len(full_text) <= len(self._context_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(self._context_text):]
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._context_text = self._decode(self._window)
        return delta

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Decode ``new_ids`` (one step's tokens) and return the text now safe to show."""
        if self.stopped:
            return ""
        new_start = len(self._text)
        self._text += "".join(self._decode_next(t) for t in new_ids)
        if len(self._text) == new_start:
            return ""
        if not self._stops:
            return self._take(len(self._text))
        match = self._stops.find(self._text, new_start)
        if match is None:
            return self._take(len(self._text) - self._stops.hold_len(self._text))
        index, stop = match
        self._text = self._text[:self._stops.end_of_output(index, stop)]
        self.stopped = True
        self.stop_reason = stop
        return self._take(len(self._text))

    def flush(self) -> str:
        """The held-back text, for a request that finished without its stop string."""
        return "" if self.stopped else self._take(len(self._text))

    def _take(self, end: int) -> str:
        assert end >= self._num_returned, "returned text is never taken back"
        delta = self._text[self._num_returned:end]
        self._num_returned = end
        return delta
