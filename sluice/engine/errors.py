"""The one error type the engine raises for bad input: a request parameter, a model file, a message.

It subclasses ValueError so callers that only know "bad value" still catch it, and it carries the
name of what was at fault (`field`) so an error event can point the client at it.
"""

from __future__ import annotations


class EngineError(ValueError):
    """Bad input to the engine. `field` names the parameter or file at fault (None if neither)."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        self.reason = message
        # The message names the field, so a log line or an error event is useful on its own.
        super().__init__(f"{field}: {message}" if field else message)
