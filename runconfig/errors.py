"""The one error a config can raise: it names the key at fault (exit 2 at the command line)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """An invalid config or argument; ``key`` is the dotted key at fault.

    ``suggestion`` is the closest known dotted key for an unknown one (else None); the message
    then ends with ``; did you mean 'x.y'?``.
    """

    def __init__(self, key: str, message: str, suggestion: str | None = None) -> None:
        text = f"invalid config key '{key}': {message}"
        if suggestion:
            text += f"; did you mean '{suggestion}'?"
        super().__init__(text)
        self.key = key
        self.message = message
        self.suggestion = suggestion
