"""The error every layer raises for a bad user-supplied value.

The server turns it into an HTTP 400 with an OpenAI error body naming ``param``; the
CLI into one line on stderr and exit status 2. Standard library only.
"""

from __future__ import annotations


class InvalidParameterError(ValueError):
    """A user-supplied value is out of range; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
