"""``rlbus redis``: an embedded Redis (:class:`rlbus.redis_server.EmbeddedRedis`) in the foreground,
its URL printed, until SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
from typing import IO

from bus import redact_url
from rlbus.redis_server import EmbeddedRedis

__all__ = ["remote_line", "serve_forever"]


def remote_line(bind: str, port: int, password: str) -> str:
    """The line ``rlbus redis --bind`` prints for other machines: the URL to put in their
    ``redis.url`` (a wildcard bind address is shown as this host's name)."""
    host = socket.gethostname() if bind in ("0.0.0.0", "::") else bind
    host = f"[{host}]" if ":" in host else host
    return (f"also listening on {bind}:{port}; from other machines: "
            f"redis.url=redis://:{password}@{host}:{port}/0")


def serve_forever(
    dir: str | os.PathLike[str],
    port: int | None = None,
    binary: str | None = None,
    *,
    password: str | None = None,
    appendonly: bool = True,
    out: IO[str] | None = None,
    bind: str | None = None,
    shown_password: str | None = None,
) -> int:
    """Run an embedded Redis in the foreground (``rlbus redis``).

    Prints its URL (``redis://127.0.0.1:PORT/0``; a password is shown as ``***``) on one line;
    with ``bind`` (an address listened on too, which needs ``password``) a second line gives
    the URL other machines use, with ``shown_password`` in it (the generated password, shown
    this once, or a ``${VAR}`` placeholder). Then blocks until SIGINT/SIGTERM and stops the
    server cleanly. Returns 0 after a clean stop, 1 if the server died by itself (its log
    tail goes to stderr). Main thread only.
    """
    stream = out if out is not None else sys.stdout
    received: list[int] = []

    def _handler(signum: int, frame: object) -> None:
        # Only a list append: a handler that takes a lock (threading.Event.set) deadlocks
        # when the signal lands while the main thread holds that lock inside Event.wait.
        received.append(signum)

    # The wakeup fd wakes the select below as soon as a signal arrives.
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    previous_fd = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    previous = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with EmbeddedRedis(
            dir, port=port, binary=binary, password=password, appendonly=appendonly, bind=bind
        ) as server:
            print(redact_url(server.url), file=stream, flush=True)
            if bind:
                print(remote_line(bind, server.port, shown_password or "***"), file=stream,
                      flush=True)
            # Wake twice a second to notice a server that died on its own.
            while not received:
                if select.select([wake_r], [], [], 0.5)[0]:
                    with contextlib.suppress(OSError):
                        wake_r.recv(64)
                if not received and not server.running:
                    print(
                        f"redis-server exited unexpectedly; log tail:\n{server.log_tail()}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
        return 0
    finally:
        signal.set_wakeup_fd(previous_fd)
        wake_r.close()
        wake_w.close()
        for sig, old in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)
