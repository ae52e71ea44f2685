"""Redis URLs: ``${VAR}`` placeholders filled from the environment, the cluster forms, the
one line that says a server cannot be reached or refused the credentials, and the host a URL
names with this machine's address on the route to it (where peers that reach the same Redis
can reach this process: the collective weight transport's default address)."""

from __future__ import annotations

import os
import re
import socket
from urllib.parse import urlsplit

from bus.errors import BusAuthError, BusPermissionError, BusUnavailable, seconds

__all__ = ["CLUSTER_SCHEMES", "as_cluster_url", "bus_error_line", "expand_env", "local_address",
           "redis_host", "split_cluster"]

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(url: str) -> str:
    """``url`` with every ``${VAR}`` replaced from the environment, so a password can live in
    the environment while configs, logs and the run's RunStarted event keep the placeholder.
    An unset variable raises :class:`KeyError` naming it."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise KeyError(name)
        return os.environ[name]

    return _ENV_REF.sub(sub, url)


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""The URL schemes naming a Redis Cluster, and the plain scheme each stands for."""


def split_cluster(url: str) -> tuple[str, bool]:
    """``(plain_url, is_cluster)``: ``redis+cluster://H:P/0`` -> ``("redis://H:P/0", True)``
    (``rediss+cluster`` likewise); any other URL is returned as it is, with ``False``."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower()) if sep else None
    if plain is None:
        return url, False
    return f"{plain}://{rest}", True


def as_cluster_url(url: str) -> str:
    """``url`` in its cluster form (``redis.cluster: true``): ``redis://`` becomes
    ``redis+cluster://``, ``rediss://`` ``rediss+cluster://``; a cluster URL is kept. Raises
    :class:`ValueError` for a scheme a cluster cannot have (``unix://``)."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() in CLUSTER_SCHEMES:
        return url
    if not sep or scheme.lower() not in CLUSTER_SCHEMES.values():
        raise ValueError(f"a Redis Cluster needs a redis:// or rediss:// URL, not {scheme}://")
    return f"{scheme.lower()}+cluster://{rest}"


def bus_error_line(name: str, exc: BusUnavailable | BusAuthError) -> str:
    """One line for an unreachable Redis or refused credentials: what failed, what to try."""
    if isinstance(exc, BusPermissionError):
        return (f"{name}: error: {exc} (the user in redis.url lacks that right; the rights of "
                "each role are in deploy/redis/users.acl, made by bus/acl.py)")
    if isinstance(exc, BusAuthError):
        return (f"{name}: error: {exc} (check the user and password in redis.url, or the "
                "environment variable it names)")
    spent = f" in {seconds(exc.waited_s)} s" if exc.waited_s is not None else ""
    bound = (f"; gave up after {seconds(exc.budget_s)} s, redis.give_up_s"
             if exc.budget_s is not None else "")
    return (f"{name}: error: cannot reach Redis at {exc.url} ({exc.op} failed after "
            f"{exc.attempts} attempt(s){spent}{bound}); is the server running there? "
            "check redis.url")


def redis_host(url: str) -> str:
    """The host of a Redis URL (``127.0.0.1`` for a unix socket)."""
    return urlsplit(url).hostname or "127.0.0.1"


def local_address(toward: str, port: int = 9) -> str:
    """This machine's address on the route to ``toward`` (a UDP socket's connect sends
    nothing): what a peer there can reach us at. ``127.0.0.1`` when ``toward`` is local or
    cannot be resolved."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((toward, port))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
