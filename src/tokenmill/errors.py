"""The errors a user can cause: a bad value, a model that cannot be loaded.

The server turns either into an HTTP 400 with an OpenAI error body (naming ``param``
where there is one); the CLI into one line on stderr and exit status 2. Standard library
only.
"""

from __future__ import annotations


class InvalidParameterError(ValueError):
    """A user-supplied value is out of range; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(ValueError):
    """A model cannot be loaded; the message is one line, fit to show a user as is."""
