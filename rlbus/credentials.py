"""Credentials from the environment: ``redis.url`` may name ``${VAR}`` for its password.

The placeholder stays in configs, logs and the run's RunStarted event; only the connection
sees the expanded URL. Nothing here prints a password (see :func:`bus.redact_url`).
"""

from __future__ import annotations

from bus.errors import redact_url
from runconfig import Config, ConfigError

__all__ = ["expand_or_fail", "expanded_url"]


def expand_or_fail(url: str) -> str:
    """``url`` with ``${VAR}`` expanded; an unset variable is a ConfigError on redis.url."""
    from bus.urls import expand_env  # the bus client: only once there is a URL to use

    try:
        return expand_env(url)
    except KeyError as exc:
        raise ConfigError(
            "redis.url", f"environment variable {exc.args[0]} (named in {redact_url(url)}) "
            "is not set"
        ) from None


def expanded_url(cfg: Config) -> str | None:
    """``cfg.redis.url`` ready to connect with (None when it is not set)."""
    return None if cfg.redis.url is None else expand_or_fail(cfg.redis.url)
