"""Errors raised by :mod:`bus`. Everything derives from :class:`BusError`.

Callers catch the specific class they can act on (a :class:`GroupGone` is fatal for a consumer,
a :class:`BusUnavailable` may be worth waiting out at a higher level) and let the rest bubble.
No class here carries a password: URLs are always redacted before they reach a message.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "BlobCorrupt",
    "BlobError",
    "BlobNotFound",
    "BusAuthError",
    "BusCannotPersist",
    "BusClusterError",
    "BusError",
    "BusOutOfMemory",
    "BusPermissionError",
    "BusRefusedWrite",
    "BusUnavailable",
    "EntryGone",
    "Fenced",
    "GoneError",
    "GroupGone",
    "PortInUse",
    "RedisBinaryNotFound",
    "RedisStartError",
    "StreamGone",
    "redact_url",
    "server_refusal",
]


class BusError(Exception):
    """Base of every error raised by the bus package."""


class BusUnavailable(BusError):
    """Redis did not answer within the retry budget.

    ``url`` is the redacted URL (no password), ``op`` the command that failed, ``attempts``
    how many times it was tried, ``waited_s`` the seconds from its first try to giving up,
    ``budget_s`` the wall-clock budget it gave up at (``None`` when it gave up at its
    count of attempts instead).
    """

    def __init__(
        self,
        url: str,
        op: str,
        attempts: int,
        cause: BaseException | None,
        *,
        waited_s: float | None = None,
        budget_s: float | None = None,
    ) -> None:
        detail = describe(cause) if cause is not None else "no answer"
        spent = f" in {seconds(waited_s)} s" if waited_s is not None else ""
        bound = f"; the bus gives up after {seconds(budget_s)} s" if budget_s is not None else ""
        super().__init__(
            f"Redis at {url} is unavailable: {op} failed after {attempts} attempt(s){spent}"
            f"{bound} ({detail})"
        )
        self.url = url
        self.op = op
        self.attempts = attempts
        self.waited_s = waited_s
        self.budget_s = budget_s


class EntryGone(BusError):
    """A write refused because an entry it depends on is no longer in its stream (Redis
    came back without its last writes)."""

    def __init__(self, stream: str, entry_id: str) -> None:
        super().__init__(f"entry {entry_id} is no longer in {stream}")
        self.stream = stream
        self.entry_id = entry_id


class Fenced(BusError):
    """A write refused because another token holds the fencing lease (a second trainer, or
    this one after its lease lapsed while it was paused)."""

    def __init__(self, key: str, token: str, holder: str | None) -> None:
        who = f"now held by {holder}" if holder else "now free (it lapsed)"
        super().__init__(f"lease {key} is no longer ours ({token}): {who}")
        self.key = key
        self.token = token
        self.holder = holder


class BusAuthError(BusError):
    """Redis refused our credentials (retrying cannot help)."""


class BusPermissionError(BusAuthError):
    """Redis's ACL refused a command or key to our user (NOPERM): the user lacks that right
    (retrying cannot help). The message names the command, the key or command refused, and
    the user."""


class BusRefusedWrite(BusError):
    """Redis refused a write for a state of its own, not ours: retrying cannot help until
    an operator acts (frees memory or disk). The message names the server and the numbers
    it gave."""


class BusOutOfMemory(BusRefusedWrite):
    """OOM: the server's ``used_memory`` reached its ``maxmemory`` and its policy evicts
    nothing it may (``noeviction``, or only keys with a TTL under ``volatile-*``)."""


class BusCannotPersist(BusRefusedWrite):
    """MISCONF: the server could not write its RDB snapshot or its AOF (a full or read-only
    disk, most often) and refuses writes until it can (``stop-writes-on-bgsave-error``, or
    an AOF write error)."""


def server_refusal(message: str) -> type[BusRefusedWrite] | None:
    """The bus error for a Redis error reply ``message`` that refuses a write for the
    server's own state (None: another error, for the caller)."""
    # The reply's code leads, or, raised by a command inside a Lua script, follows the
    # script's own "Error running script" prefix.
    words = message.replace(":", " ").split()
    if "OOM" in words[:12] or "OOM command not allowed" in message:
        return BusOutOfMemory
    if "MISCONF" in words[:12]:
        return BusCannotPersist
    return None


class BusClusterError(BusError):
    """``redis.url`` and the server disagree about Redis Cluster: a plain URL names a node of a
    cluster (which would answer MOVED for the keys of other slots), or a cluster URL names a
    server that is not one. A configuration error: retrying cannot help."""

    def __init__(self, url: str, *, is_cluster: bool) -> None:
        if is_cluster:
            what = ("names a node of a Redis Cluster; use redis+cluster:// or "
                    "redis.cluster: true")
        else:
            what = ("is a cluster URL (redis+cluster:// or redis.cluster: true) but the server "
                    "is not a Redis Cluster node; use redis://")
        super().__init__(f"redis.url {url} {what}")
        self.url = url


class GoneError(BusError):
    """A stream or consumer group a consumer relies on no longer exists (NOGROUP)."""

    def __init__(self, stream: str, group: str, message: str) -> None:
        super().__init__(message)
        self.stream = stream
        self.group = group


class StreamGone(GoneError):
    """The stream was deleted while a consumer group was reading it."""

    def __init__(self, stream: str, group: str) -> None:
        super().__init__(
            stream,
            group,
            f"stream {stream!r} no longer exists (consumer group {group!r} went with it); "
            "it was deleted or never created: refusing to recreate it silently",
        )


class GroupGone(GoneError):
    """The consumer group was destroyed (XGROUP DESTROY) while the stream still exists."""

    def __init__(self, stream: str, group: str) -> None:
        super().__init__(
            stream,
            group,
            f"consumer group {group!r} of stream {stream!r} no longer exists "
            "(destroyed with XGROUP DESTROY?): refusing to recreate it silently",
        )


class BlobError(BusError):
    """Base of blob-store errors."""


class BlobNotFound(BlobError):
    """A blob reference points at nothing at all."""


class BlobCorrupt(BlobError):
    """A blob exists but a chunk is missing or its size/sha256 differ from the reference."""


class RedisBinaryNotFound(BusError):
    """No redis-server executable could be found."""


class RedisStartError(BusError):
    """redis-server exited or did not answer PING in time; the message has its log tail."""


class PortInUse(BusError):
    """The requested TCP port is already taken on 127.0.0.1."""


def describe(exc: BaseException) -> str:
    """``TimeoutError`` or ``ConnectionError: Connection refused``: the class, and the
    message when there is one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def seconds(value: float) -> str:
    """``value`` seconds for a message: ``60``, ``2.5``, ``0.3`` (one decimal at most)."""
    return f"{round(value, 1):g}"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))
