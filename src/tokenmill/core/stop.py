"""Stop strings over a growing text: find the first match, and what to hold back meanwhile.

A stop string may arrive split over several tokens, so text that could still become
one is held back ("hold") until later text rules it out or completes it::

    text:  ...already returned...|..returnable..|..hold..|
                                                 ^ len(text) - hold_len(text)

    hold = the longest suffix of the text that is a proper prefix of some stop string
    (nothing is held when the stop string itself is returned: the held text would be
    returned either way).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Matcher for a fixed set of non-empty stop strings."""

    def __init__(self, stops: Sequence[str], include_in_output: bool) -> None:
        assert all(stops), "stop strings are validated non-empty"
        self.stops = tuple(dict.fromkeys(stops))
        self.include_in_output = include_in_output
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._proper_prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, new_start: int) -> tuple[int, str] | None:
        """Earliest match that ends after ``new_start`` (where unseen text begins).

        Returns ``(index, stop)``; among matches at the same index, the longest stop wins.
        Matches ending at or before ``new_start`` were found by an earlier call.
        """
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = text.find(stop, max(0, new_start - len(stop) + 1))
            if i >= 0 and (best is None or i < best[0]
                           or (i == best[0] and len(stop) > len(best[1]))):
                best = (i, stop)
        return best

    def end_of_output(self, index: int, stop: str) -> int:
        """Where the returned text ends for a match of ``stop`` at ``index``."""
        return index + len(stop) if self.include_in_output else index

    def hold_len(self, text: str) -> int:
        """Length of the suffix of ``text`` that must be held back (see module docstring)."""
        if self.include_in_output:
            return 0
        for k in range(min(len(text), self._max_len - 1), 0, -1):
            if text[-k:] in self._proper_prefixes:
                return k
        return 0
