"""No silent waits on Redis: a stopped server is reported while a command waits, and a command
gives up at one wall-clock budget (not tries x deadline) with the one-line error naming it.

The server is held with SIGSTOP (it keeps accepting connections and never answers), and the
silence threshold is made short through the bus's options so the tests stay short. Every
SIGSTOP has its SIGCONT in a ``finally``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import pytest

from bus import (
    BUDGET_S,
    FIRST_CONTACT_S,
    Bus,
    BusUnavailable,
    Consumer,
    RetryPolicy,
    bus_error_line,
    retry_async,
)
from rlbus.redis_binary import free_port
from rlbus.redis_server import EmbeddedRedis

QUICK_WARN = {"silence_warn_s": 0.3, "silence_repeat_s": 0.5}


@contextmanager
def stopped(server: EmbeddedRedis) -> Iterator[None]:
    """``server`` holds still (SIGSTOP) inside the block; SIGCONT whatever happens."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def silence_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "bus.client" and r.levelno == logging.WARNING]


async def until(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 (log records come with no event to wait on)
            await asyncio.sleep(0.05)


# ---------------------------------------------------------------------- the budget, pure


def test_the_wait_before_each_try_doubles_up_to_its_cap() -> None:
    p = RetryPolicy(base_s=0.5, max_s=2.0, jitter=0.0, budget_s=100.0)
    assert [p.next_delay_s(k, elapsed_s=0.0) for k in (1, 2, 3, 4, 5)] == [
        0.5, 1.0, 2.0, 2.0, 2.0]


def test_no_try_begins_at_or_past_the_budget() -> None:
    p = RetryPolicy(base_s=1.0, max_s=1.0, jitter=0.0, budget_s=10.0)
    assert p.next_delay_s(3, elapsed_s=8.9) == 1.0
    assert p.next_delay_s(3, elapsed_s=9.0) is None
    assert p.next_delay_s(3, elapsed_s=30.0) is None  # one hung try spent it all
    assert p.next_delay_s(3, elapsed_s=9.5, budget_s=20.0) == 1.0  # a budget given instead


def test_the_budget_alone_bounds_a_policy_without_a_count_of_tries() -> None:
    p = RetryPolicy(jitter=0.0)
    assert p.attempts is None and p.budget_s == BUDGET_S and p.first_contact_s == FIRST_CONTACT_S
    assert p.next_delay_s(1000, elapsed_s=1.0) == p.max_s
    counted = RetryPolicy(attempts=3, jitter=0.0)
    assert counted.next_delay_s(2, elapsed_s=0.0) is not None
    assert counted.next_delay_s(3, elapsed_s=0.0) is None


def test_bad_policies_are_refused() -> None:
    for kwargs in ({"attempts": 0}, {"budget_s": 0.0}, {"first_contact_s": -1.0},
                   {"jitter": 2.0}):
        with pytest.raises(ValueError):
            RetryPolicy(**kwargs)  # type: ignore[arg-type]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.asyncio
async def test_hung_tries_give_up_at_the_budget_not_after_tries_times_the_deadline() -> None:
    # Each try hangs until its deadline: 30 s, or the budget left when less. With a 60 s
    # budget that is two tries (before: 10 tries x 30 s = 300 s).
    clock, lefts = FakeClock(), []

    async def hangs(left_s: float) -> None:
        lefts.append(left_s)
        clock.now += min(30.0, left_s)
        raise TimeoutError

    policy = RetryPolicy(base_s=0.0, jitter=0.0, budget_s=60.0)
    with pytest.raises(TimeoutError):
        await retry_async(policy, hangs, retry_on=(TimeoutError,), clock=clock)
    assert lefts == [60.0, 30.0] and clock.now == 60.0


@pytest.mark.asyncio
async def test_refused_tries_go_on_until_the_budget() -> None:
    clock, tries = FakeClock(), []

    async def refused(left_s: float) -> None:
        tries.append(left_s)
        clock.now += 1.0  # each refused try (and its wait) takes a second here
        raise ConnectionError

    policy = RetryPolicy(base_s=0.0, jitter=0.0, budget_s=10.0)
    with pytest.raises(ConnectionError):
        await retry_async(policy, refused, retry_on=(ConnectionError,), clock=clock)
    assert len(tries) == 10 and clock.now == 10.0


def test_the_error_names_the_budget_it_gave_up_at() -> None:
    exc = BusUnavailable("redis://127.0.0.1:1/0", "PING", 2, TimeoutError(),
                         waited_s=60.01, budget_s=60.0)
    assert "PING failed after 2 attempt(s) in 60 s; the bus gives up after 60 s" in str(exc)
    line = bus_error_line("trainer", exc)
    assert "\n" not in line and "gave up after 60 s, redis.give_up_s" in line
    assert "redis://127.0.0.1:1/0" in line
    counted = BusUnavailable("redis://h:1/0", "PING", 3, TimeoutError(), waited_s=0.6)
    assert "gives up after" not in str(counted) and "3 attempt(s) in 0.6 s" in str(counted)


# ---------------------------------------------------------------------- a stopped server


@pytest.mark.asyncio
async def test_a_stopped_server_is_reported_while_a_command_waits_then_it_answers(
    redis_factory: Callable[..., EmbeddedRedis], make_bus: Callable[..., Awaitable[Bus]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="bus.client")
    server = redis_factory()
    # A short try deadline: the read hangs, is retried on a new connection, hangs again.
    bus = await make_bus(server.url, op_timeout_s=0.5, **QUICK_WARN)
    await Consumer(bus, "s", "g", "c").ensure_group()
    with stopped(server):
        read = asyncio.create_task(bus.command(
            "XREADGROUP", "GROUP", "g", "c", "COUNT", 1, "BLOCK", 200, "STREAMS", "s", ">",
            block_ms=200))
        await until(lambda: len(silence_lines(caplog)) >= 2)
        alone = silence_lines(caplog)
        ping = asyncio.create_task(bus.ping())  # a second call: still one line per period
        await until(lambda: any("also waiting: " in ln for ln in silence_lines(caplog)))
    async with asyncio.timeout(15):
        assert await read is None  # answered (nothing new) once the server runs again
        await ping
    for line in alone:
        assert line.startswith(f"redis {bus.url} has not answered XREADGROUP for ")
        assert "past its 0.2 s BLOCK" in line and "waiting up to 600 s (redis.give_up_s)" in line
    lines = silence_lines(caplog)
    assert any("try(s), last: TimeoutError" in ln for ln in lines)  # tries were retried
    both = [ln for ln in lines if "also waiting: " in ln]
    assert all(("has not answered PING" in ln and "also waiting: XREADGROUP" in ln)
               or ("has not answered XREADGROUP" in ln and "also waiting: PING" in ln)
               for ln in both)


@pytest.mark.asyncio
async def test_a_stopped_server_gives_the_one_line_error_at_the_budget(
    redis_factory: Callable[..., EmbeddedRedis], make_bus: Callable[..., Awaitable[Bus]],
) -> None:
    server = redis_factory()
    # The usual 30 s try deadline; the 1 s budget bounds the one hung try instead.
    bus = await make_bus(server.url, retry=RetryPolicy(budget_s=1.0), **QUICK_WARN)
    await bus.ping()
    with stopped(server), pytest.raises(BusUnavailable) as info:
        async with asyncio.timeout(15):
            await bus.command("SET", "k", "v")
    exc = info.value
    assert exc.op == "SET" and exc.budget_s == 1.0 and exc.attempts == 1
    assert f"127.0.0.1:{server.port}" in str(exc) and "gives up after 1 s" in str(exc)
    assert "gave up after 1 s" in bus_error_line("trainer", exc)
    await bus.ping()  # and the client works again once the server does


@pytest.mark.asyncio
async def test_a_server_never_reached_fails_at_the_first_contact_budget_quietly(
    make_bus: Callable[..., Awaitable[Bus]], caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="bus.client")
    url = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens
    policy = RetryPolicy(first_contact_s=1.0)
    bus = await make_bus(url, retry=policy, silence_warn_s=0.1, silence_repeat_s=0.1)
    with pytest.raises(BusUnavailable) as info:
        async with asyncio.timeout(15):
            await bus.ping()
    assert info.value.budget_s == 1.0 and info.value.attempts > 1
    assert silence_lines(caplog) == []  # the caller's one-line error says it


SCRIPT = """
import asyncio, os, signal, sys
from bus import Bus

async def main(url, pid):
    bus = Bus.from_url(url, silence_warn_s=0.3, silence_repeat_s=0.5)
    await bus.ping()
    os.kill(pid, signal.SIGSTOP)
    asyncio.get_running_loop().call_later(1.5, os.kill, pid, signal.SIGCONT)
    await bus.command("SET", "k", "v")
    print("answered", flush=True)
    await bus.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def test_the_warning_reaches_stderr_of_a_process_that_configured_no_logging(
    redis_factory: Callable[..., EmbeddedRedis],
) -> None:
    server = redis_factory()
    assert server.pid is not None
    try:
        res = subprocess.run([sys.executable, "-c", SCRIPT, server.url, str(server.pid)],
                             capture_output=True, text=True, timeout=60, check=False)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert res.returncode == 0 and res.stdout == "answered\n", res.stderr
    lines = res.stderr.splitlines()
    assert lines and all(
        ln.startswith(f"redis {server.url} has not answered SET for ") for ln in lines), lines
