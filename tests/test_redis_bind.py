"""``rlbus redis --bind ADDR``: listening beyond 127.0.0.1 needs a password (from
$RLBUS_REDIS_PASSWORD or generated and shown once), and other machines reach it with it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from rlbus.redis_server import EmbeddedRedis
from tests.procs import run_cli

pytestmark = pytest.mark.procs  # each test runs `rlbus redis` as a process

# Any 127/8 address is loopback on Linux: a second address stands for "another interface".
ADDR = "127.0.0.2"


@contextmanager
def _rlbus_redis(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[
    tuple[str, str]
]:
    """``rlbus redis ARGS`` running; yields its first two lines (local URL, remote line)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbus", "redis", f"run.output_dir={tmp_path}", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    try:
        assert proc.stdout is not None
        first, second = proc.stdout.readline().strip(), proc.stdout.readline().strip()
        assert first and second, proc.stderr.read() if proc.stderr else ""
        yield first, second
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def _remote_url(line: str) -> str:
    match = re.search(r"redis\.url=(\S+)", line)
    assert match, line
    return match.group(1)


def test_bind_generates_a_password_shown_once_and_other_hosts_reach_it(tmp_path: Path) -> None:
    with _rlbus_redis(tmp_path, "--bind", ADDR) as (local, remote):
        assert local.startswith("redis://:***@127.0.0.1:"), local  # never the password here
        url = _remote_url(remote)
        assert f"@{ADDR}:" in url and "***" not in url, remote
        client = redis.Redis.from_url(url, socket_timeout=10)
        assert client.ping()
        client.close()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        anonymous = redis.Redis(host=ADDR, port=port, socket_timeout=10)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()


def test_bind_takes_the_password_from_the_environment(tmp_path: Path) -> None:
    with _rlbus_redis(tmp_path, "--bind", ADDR, env={"RLBUS_REDIS_PASSWORD": "s3cret"}) as (
        _, remote
    ):
        url = _remote_url(remote)
        # The line names the variable, not its value (configs keep the placeholder).
        assert url.startswith("redis://:${RLBUS_REDIS_PASSWORD}@"), remote
        client = redis.Redis.from_url(url.replace("${RLBUS_REDIS_PASSWORD}", "s3cret"),
                                      socket_timeout=10)
        assert client.ping()
        client.close()


def test_bind_needs_an_ip_address_and_a_password(tmp_path: Path) -> None:
    bad = run_cli("redis", "--bind", "not-an-address", f"run.output_dir={tmp_path}")
    assert bad.returncode == 2 and "--bind" in bad.stderr, bad.stderr
    with pytest.raises(ValueError, match="needs a password"):
        EmbeddedRedis(tmp_path / "r", bind=ADDR)
