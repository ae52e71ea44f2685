"""A silent Redis is waited out for ``redis.give_up_s``; a process that did not run is not a
silent Redis; peers are judged by the time Redis could be reached.

The decisions first, pure (bus.reach, bus.retry), then the bus client against a real
redis-server: its event loop blocked (what a SIGSTOP of the process looks like from inside)
past a call's budget, and the server stopped past the reach clock's grace.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable

import pytest

from bus import PAUSE_S, Bus, BusUnavailable, Consumer, Reach, RetryPolicy, Stalls, bus_error_line
from rlbus.redis_server import EmbeddedRedis
from runconfig import load_config

# ---------------------------------------------------------------------- the decisions


def test_a_late_tick_is_a_pause_only_past_the_bound() -> None:
    s = Stalls(pause_s=5.0)
    assert s.pending(now=100.0) == 0.0  # not armed: nothing to time
    s.armed(due=10.0)
    assert s.pending(now=14.9) == 0.0  # a busy loop, not a pause
    assert s.clock(now=14.9) == 14.9
    assert s.pending(now=70.0) == 60.0
    assert s.clock(now=70.0) == 10.0  # still pending: already left out
    assert s.fired(now=70.0) == 60.0 and s.paused_s == 60.0
    assert s.clock(now=75.0) == 15.0  # counted once
    s.armed(due=76.0)
    assert s.fired(now=77.0) == 0.0 and s.paused_s == 60.0
    with pytest.raises(ValueError):
        Stalls(pause_s=0.0)


def test_the_give_up_decision_counts_redis_silence_not_the_process_pause() -> None:
    # A read began at 0 s; the process was stopped from 1 s to 61 s; its try's deadline
    # passed while it did not run. Before: 61 s elapsed of a 60 s budget, give up ("cannot
    # reach Redis ... XREADGROUP failed ... 60.1 s"). Now: 1 s of Redis's time.
    policy = RetryPolicy(jitter=0.0, budget_s=60.0)
    s = Stalls()
    s.armed(due=1.0)
    elapsed_loop = 61.0
    assert policy.next_delay_s(1, elapsed_s=elapsed_loop) is None  # the old decision
    assert policy.next_delay_s(1, elapsed_s=s.clock(61.0) - s.clock(0.0)) is not None
    # A silent Redis, this process running all along: the same budget ends it.
    running = Stalls()
    running.armed(due=60.5)  # the watchdog ran every second: never late
    assert policy.next_delay_s(9, elapsed_s=running.clock(61.0) - running.clock(0.0)) is None


def test_the_reach_clock_stops_while_redis_is_silent_and_never_runs_back() -> None:
    r = Reach(grace_s=5.0)
    assert r.clock(now=3.0, oldest=None) == 3.0 and r.since_dark_s(3.0, None) == math.inf
    r.ended(now=10.0, oldest=9.9, answered=True)
    # Silent from 10 s (a read in flight since then): runs 5 s more, then stops.
    seen = [r.clock(now=t, oldest=10.0) for t in (12.0, 15.0, 40.0, 100.0)]
    assert seen == [12.0, 15.0, 15.0, 15.0]
    assert r.since_dark_s(100.0, 10.0) == 0.0
    # A second call in flight meanwhile changes nothing; its end (unanswered) keeps it.
    assert r.clock(now=100.0, oldest=10.0) == 15.0
    r.ended(now=100.0, oldest=10.0, answered=False)
    assert r.clock(now=100.0, oldest=10.0) == 15.0
    # Redis answers at 110 s: 95 s dark in all, counted once, and the clock runs on.
    assert r.ended(now=110.0, oldest=10.0, answered=True) == 10.0
    assert r.dark_s == 95.0 and r.clock(now=111.0, oldest=None) == 16.0
    assert r.since_dark_s(112.0, None) == 2.0
    # Calls answered within the grace are not an outage.
    r.ended(now=113.0, oldest=111.0, answered=True)
    assert r.dark_s == 95.0


def test_a_peer_absent_through_an_outage_is_not_judged_by_it() -> None:
    # The trainer saw a rollouter at 10 s; Redis was silent 10-100 s; every key lapsed. By
    # the loop's clock the rollouter is gone 90 s (> heartbeat.timeout_s 30: PeerDead); by
    # the reach clock 5 s (the grace), and it re-pulses within an interval.
    r = Reach(grace_s=5.0)
    r.ended(now=10.0, oldest=9.9, answered=True)
    seen_at = r.clock(now=10.0, oldest=None)
    r.ended(now=100.0, oldest=10.0, answered=True)
    assert 100.0 - 10.0 >= 30.0
    assert r.clock(now=100.0, oldest=None) - seen_at == 5.0


def test_give_up_s_is_a_config_key_with_a_long_default() -> None:
    assert load_config(None, []).redis.give_up_s == 600.0
    assert load_config(None, ["redis.give_up_s=40"]).redis.give_up_s == 40.0


# ---------------------------------------------------------------------- the bus client


@pytest.mark.asyncio
async def test_a_process_that_did_not_run_retries_instead_of_blaming_redis(
    redis_factory: Callable[..., EmbeddedRedis], make_bus: Callable[..., Awaitable[Bus]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The event loop blocked (as a SIGSTOP of the process looks from inside) past a read's
    deadline and its whole budget: the read is tried again and answered, one WARNING says
    the process did not run, and the owner's hook hears of it."""
    caplog.set_level(logging.WARNING, logger="bus.client")
    server = redis_factory()
    budget_s = 2.0
    bus = await make_bus(server.url, retry=RetryPolicy(budget_s=budget_s),
                         silence_warn_s=1.0, silence_repeat_s=1.0)
    await Consumer(bus, "s", "g", "c").ensure_group()
    paused: list[float] = []
    bus.on_pause = paused.append
    read = asyncio.create_task(bus.command(
        "XREADGROUP", "GROUP", "g", "c", "COUNT", 1, "BLOCK", 500, "STREAMS", "s", ">",
        block_ms=500))
    await asyncio.sleep(0.2)  # sent, waiting for its answer
    time.sleep(PAUSE_S + budget_s)  # noqa: ASYNC251 (the loop must not run: that is the test)
    async with asyncio.timeout(15):
        assert await read is None  # answered: nothing new
    await asyncio.sleep(0.5)
    assert paused and paused[0] >= PAUSE_S  # the hook says it: the bus does not
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == []  # and nothing was blamed on Redis
    # Without a hook, the bus says it.
    bus.on_pause = None
    read = asyncio.create_task(bus.command("BLPOP", "nothing", 0.5, block_ms=500))
    await asyncio.sleep(0.2)
    time.sleep(PAUSE_S + 0.5)  # noqa: ASYNC251
    async with asyncio.timeout(15):
        assert await read is None
    await asyncio.sleep(0.5)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and lines[0].startswith("this process did not run for "), lines


@pytest.mark.asyncio
async def test_a_silent_redis_is_waited_out_and_the_reach_clock_stops_meanwhile(
    redis_factory: Callable[..., EmbeddedRedis], make_bus: Callable[..., Awaitable[Bus]],
) -> None:
    """Redis stopped 8 s with a read in flight: the read answers afterwards, the reach clock
    moved about the 5 s grace (not 8 s), and the outage is recent."""
    server = redis_factory()
    assert server.pid is not None
    bus = await make_bus(server.url, op_timeout_s=2.0, silence_warn_s=1.0,
                         silence_repeat_s=1.0)
    await Consumer(bus, "s", "g", "c").ensure_group()
    assert bus.since_dark_s() == math.inf
    loop = asyncio.get_running_loop()
    t0, r0 = loop.time(), bus.reach_clock()
    os.kill(server.pid, signal.SIGSTOP)
    try:
        read = asyncio.create_task(bus.command(
            "XREADGROUP", "GROUP", "g", "c", "COUNT", 1, "BLOCK", 100, "STREAMS", "s", ">",
            block_ms=100))
        await asyncio.sleep(8.0)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    async with asyncio.timeout(15):
        assert await read is None
    waited, reached = loop.time() - t0, bus.reach_clock() - r0
    assert waited >= 8.0 and reached < waited - 2.0, (waited, reached)
    assert bus.since_dark_s() < 5.0


@pytest.mark.asyncio
async def test_a_silent_redis_past_the_budget_is_one_error_naming_the_key(
    redis_factory: Callable[..., EmbeddedRedis], make_bus: Callable[..., Awaitable[Bus]],
) -> None:
    server = redis_factory()
    assert server.pid is not None
    bus = await make_bus(server.url, retry=RetryPolicy(budget_s=1.5))
    await bus.ping()
    os.kill(server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(BusUnavailable) as info:
            async with asyncio.timeout(15):
                await bus.command("SET", "k", "v")
    finally:
        os.kill(server.pid, signal.SIGCONT)
    line = bus_error_line("rollouter0", info.value)
    assert "cannot reach Redis at redis://127.0.0.1:" in line
    assert "gave up after 1.5 s, redis.give_up_s" in line
