"""Streams against a real redis-server: groups, crashes, poison, trimming, outages."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import (
    EXCEEDED_REASON,
    TRIMMED_REASON,
    BadEntry,
    Bus,
    BusAuthError,
    BusUnavailable,
    Consumer,
    GroupGone,
    RetryPolicy,
    RunKeys,
    StreamGone,
    default_dlq,
)
from rlbus.redis_server import EmbeddedRedis
from runschema.messages import FIELD, DeadLetter, Heartbeat, StepStarted, decode, encode
from runtime import Follower

HELPER = Path(__file__).with_name("helpers_consumer.py")
FAST_FAIL = RetryPolicy(attempts=3, base_s=0.01, max_s=0.05)


def steps(n: int, start: int = 0) -> list[StepStarted]:
    return [StepStarted(step=start + i, param_version=0) for i in range(n)]


async def dead_letters(bus: Bus, dlq: str) -> list[DeadLetter]:
    out = []
    async for entry in bus.read_all(dlq):
        assert isinstance(entry.msg, DeadLetter)
        out.append(entry.msg)
    return out


async def pending_count(bus: Bus, stream: str, group: str) -> int:
    summary = await bus.command("XPENDING", stream, group)
    return int(summary[0])


async def read_until(consumer: Consumer, n: int, timeout_s: float = 10.0) -> list:
    """Read until ``n`` deliveries arrived (bounded)."""
    got: list = []
    async with asyncio.timeout(timeout_s):
        while len(got) < n:
            got += await consumer.read(count=n - len(got), block_ms=200)
    return got


# --------------------------------------------------------------------------- publishing / logs


@pytest.mark.asyncio
async def test_publish_latest_read_all(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.events
    assert await bus.latest(stream) is None
    assert [e async for e in bus.read_all(stream)] == []
    first = await bus.publish(stream, StepStarted(step=1, param_version=0))
    ids = await bus.publish_many(stream, steps(1200, start=2))
    assert len(ids) == 1200 and first < ids[0]
    assert await bus.length(stream) == 1201
    entries = [e async for e in bus.read_all(stream, count=100)]  # several XRANGE pages
    assert [e.id for e in entries] == [first, *ids]
    assert [e.msg.step for e in entries] == list(range(1, 1202))
    latest = await bus.latest(stream)
    assert latest is not None and latest.id == ids[-1] and latest.msg.step == 1201
    later = [e.id async for e in bus.read_all(stream, start=ids[-2])]
    assert later == ids[-2:]


@pytest.mark.asyncio
async def test_publish_atomic_and_multi(bus: Bus, run_keys: RunKeys) -> None:
    ids = await bus.publish_many(run_keys.samples, steps(5), atomic=True)
    assert len(ids) == 5 and await bus.length(run_keys.samples) == 5
    ids = await bus.publish_multi(
        [(run_keys.samples, StepStarted(step=9, param_version=1)), (run_keys.events, steps(1)[0])]
    )
    assert len(ids) == 2
    assert await bus.length(run_keys.samples) == 6 and await bus.length(run_keys.events) == 1
    assert await bus.publish_multi([]) == []


@pytest.mark.asyncio
async def test_read_all_and_latest_skip_garbage(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.events
    await bus.publish(stream, StepStarted(step=1, param_version=0))
    bad_id = await bus.publish_raw(stream, {FIELD: b"\xc1garbage"})
    await bus.publish_raw(stream, {b"other": b"x"})
    bad: list[BadEntry] = []
    got = [e.msg.step async for e in bus.read_all(stream, on_bad=bad.append)]
    assert got == [1]
    assert bad[0].id == bad_id and bad[0].raw == b"\xc1garbage"
    assert "no field" in bad[1].reason
    latest = await bus.latest(stream)  # walks back past the garbage
    assert latest is not None and latest.msg.step == 1


@pytest.mark.asyncio
async def test_follow_from_beginning_then_new_entries(bus: Bus, run_keys: RunKeys) -> None:
    """A follower (runtime.Follower, on read_after) reads the log from its beginning, passes
    over garbage (reported, never folded), then follows what is written next."""
    stream = run_keys.events
    await bus.publish_many(stream, steps(3))
    await bus.publish_raw(stream, {FIELD: b"junk"})
    seen: list[int] = []
    bad: list[BadEntry] = []
    follower = Follower(bus, stream, on_bad=bad.append,
                        fold=lambda entries: seen.extend(e.msg.step for e in entries))
    await follower.poll()
    assert seen == [0, 1, 2] and follower.caught_up
    async with asyncio.timeout(10):
        waiting = asyncio.create_task(follower.poll(block_ms=5000))
        await bus.publish_many(stream, steps(2, start=3))
        await waiting
        while len(seen) < 5:
            await follower.poll(block_ms=100)
    assert seen == [0, 1, 2, 3, 4]
    assert len(bad) == 1


@pytest.mark.asyncio
async def test_follow_from_the_newest_entry_sees_only_new_ones(
    bus: Bus, run_keys: RunKeys
) -> None:
    stream = run_keys.events
    await bus.publish_many(stream, steps(3))
    newest = await bus.latest(stream)
    assert newest is not None
    seen: list[int] = []
    follower = Follower(bus, stream, newest.id,
                        fold=lambda entries: seen.extend(e.msg.step for e in entries))
    assert await follower.poll() == [] and seen == []
    await bus.publish_many(stream, steps(3, start=10))
    async with asyncio.timeout(10):
        while len(seen) < 3:
            await follower.poll(block_ms=100)
    assert seen == [10, 11, 12]


@pytest.mark.asyncio
async def test_read_after_poll_loop(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.control
    assert await bus.read_after(stream, "0") == ([], "0")  # missing stream
    await bus.publish_many(stream, steps(2))
    bad_id = await bus.publish_raw(stream, {FIELD: b"\xc1"})
    entries, cursor = await bus.read_after(stream, "0", count=10)
    assert [e.msg.step for e in entries] == [0, 1]
    assert cursor == bad_id  # moves past the skipped garbage
    async with asyncio.timeout(5):
        assert await bus.read_after(stream, cursor, block_ms=50) == ([], cursor)
    await bus.publish(stream, StepStarted(step=2, param_version=0))
    entries, cursor = await bus.read_after(stream, cursor, block_ms=50)
    assert [e.msg.step for e in entries] == [2]


# --------------------------------------------------------------------------- groups


@pytest.mark.asyncio
async def test_two_members_get_disjoint_entries(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.samples
    a = Consumer(bus, stream, "trainer", "a")
    b = Consumer(bus, stream, "trainer", "b")
    assert await a.ensure_group() is True
    assert await b.ensure_group() is False  # BUSYGROUP is fine
    ids = await bus.publish_many(stream, steps(200))
    got_a: list[str] = []
    got_b: list[str] = []
    async with asyncio.timeout(10):
        while len(got_a) + len(got_b) < 200:
            for c, got in ((a, got_a), (b, got_b)):
                ds = await c.read(count=17, block_ms=50)
                got += [d.id for d in ds]
                await c.ack(*ds)
    assert set(got_a).isdisjoint(got_b)
    assert sorted(got_a + got_b) == sorted(ids)
    assert got_a and got_b
    assert await pending_count(bus, stream, "trainer") == 0
    assert a.stats.acked + b.stats.acked == 200


@pytest.mark.asyncio
async def test_publish_and_ack_lands_answers_and_acks_together(
    bus: Bus, run_keys: RunKeys
) -> None:
    # The rollouter's pipeline: answers of one batch published (and its work acked) while
    # the next read is blocked on the same consumer.
    c = Consumer(bus, run_keys.prompts, "rollouter", "r0")
    await c.ensure_group()
    await bus.publish_many(run_keys.prompts, steps(4))
    first = await c.read(count=2, block_ms=100)
    ahead = asyncio.ensure_future(c.read(count=2, block_ms=2000))
    ids = await c.publish_and_ack(run_keys.samples, steps(3, start=100), *first)
    assert len(ids) == 3
    assert [e.msg.step async for e in bus.read_all(run_keys.samples)] == [100, 101, 102]
    second = await ahead
    assert [d.msg.step for d in second] == [2, 3]
    assert await pending_count(bus, run_keys.prompts, "rollouter") == 2  # only the second
    assert c.inflight == 2 and c.stats.acked == 2
    assert await c.publish_and_ack(run_keys.samples, [], *second) == []
    assert await pending_count(bus, run_keys.prompts, "rollouter") == 0
    # Nothing to ack: a plain atomic publication.
    assert len(await c.publish_and_ack(run_keys.samples, steps(1))) == 1


@pytest.mark.asyncio
async def test_own_pending_entries_come_first(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.prompts
    c1 = Consumer(bus, stream, "rollouter", "r0")
    await c1.ensure_group()
    await bus.publish_many(stream, steps(3))
    held = await c1.read(count=3, block_ms=100)
    assert [d.deliveries for d in held] == [1, 1, 1]
    assert await c1.read(count=3, block_ms=None) == []  # own in-flight ones are not re-handed
    await bus.publish_many(stream, steps(2, start=3))
    # A restarted member with the same name gets its pending entries back first.
    c2 = Consumer(bus, stream, "rollouter", "r0")
    again = await c2.read(count=10, block_ms=100)
    assert [d.id for d in again] == [d.id for d in held]
    assert [d.deliveries for d in again] == [2, 2, 2]
    new = await c2.read(count=10, block_ms=100)
    assert [d.msg.step for d in new] == [3, 4] and [d.deliveries for d in new] == [1, 1]
    assert await c2.ack(*again, *new) == 5


@pytest.mark.asyncio
async def test_read_blocks_boundedly(bus: Bus, run_keys: RunKeys) -> None:
    c = Consumer(bus, run_keys.samples, "trainer", "t0")
    await c.ensure_group()
    async with asyncio.timeout(5):
        assert await c.read(count=10, block_ms=100) == []
        assert await c.read(count=10, block_ms=0) == []  # 0 = do not block (not "forever")


@pytest.mark.asyncio
async def test_every_call_has_a_deadline(
    redis_factory: Callable[..., EmbeddedRedis], make_bus: Callable[..., Awaitable[Bus]]
) -> None:
    # A server that accepts but never answers (SIGSTOP) must not hang a caller.
    server = redis_factory()
    bus = await make_bus(server.url, retry=FAST_FAIL, op_timeout_s=0.2)
    await bus.ping()
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(BusUnavailable, match="PING"):
            async with asyncio.timeout(10):
                await bus.ping()
    finally:
        os.kill(server.pid, signal.SIGCONT)
    await bus.ping()  # and recovers once the server answers again


@pytest.mark.procs
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_killed_member_entries_are_reclaimed_exactly_once(
    bus: Bus, redis_url: str, run_keys: RunKeys
) -> None:
    stream, group = run_keys.samples, "trainer"
    survivor = Consumer(bus, stream, group, "survivor")
    await survivor.ensure_group()
    ids = await bus.publish_many(stream, steps(30))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HELPER),
        redis_url,
        stream,
        group,
        "victim",
        "10",
        "4",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(HELPER.parent.parent)},
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = await proc.stdout.readline()
        report = json.loads(line)
        assert len(report["acked"]) == 4 and len(report["held"]) == 6
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL

    processed: list[str] = list(report["acked"])
    # The dead member's 6 entries are idle; XAUTOCLAIM (min idle 0: we know it is dead).
    reclaimed = await survivor.reclaim(min_idle_ms=0)
    assert sorted(d.id for d in reclaimed) == sorted(report["held"])
    assert all(d.deliveries == 2 for d in reclaimed)
    processed += [d.id for d in reclaimed]
    await survivor.ack(*reclaimed)
    rest = await read_until(survivor, 20)
    processed += [d.id for d in rest]
    await survivor.ack(*rest)
    assert await survivor.reclaim(min_idle_ms=0) == []
    assert sorted(processed) == sorted(ids)
    assert len(processed) == len(set(processed)) == 30
    assert await pending_count(bus, stream, group) == 0


# --------------------------------------------------------------------------- poison / DLQ


@pytest.mark.asyncio
async def test_poison_entries_go_to_dlq_and_consumer_keeps_going(
    bus: Bus, run_keys: RunKeys
) -> None:
    stream = run_keys.samples
    c = Consumer(bus, stream, "trainer", "t0", accept=(StepStarted,))
    await c.ensure_group()
    assert c.dlq_stream == run_keys.dlq
    good1 = await bus.publish(stream, StepStarted(step=1, param_version=0))
    poison = {
        "random bytes": os.urandom(64),
        "unknown type": msgspec.msgpack.encode({"type": "Bogus", "v": 1}),
        "future version": msgspec.msgpack.encode(
            {"type": "StepStarted", "v": 99, "step": 1, "param_version": 0}
        ),
        "wrong type": encode(Heartbeat(role="trainer", rank=0, pid=1)),
    }
    poison_ids = {}
    for label, raw in poison.items():
        poison_ids[label] = await bus.publish_raw(stream, {FIELD: raw})
    no_field = await bus.publish_raw(stream, {b"x": b"y"})
    good2 = await bus.publish(stream, StepStarted(step=2, param_version=0))

    got = await read_until(c, 2)
    assert [d.id for d in got] == [good1, good2]
    await c.ack(*got)
    letters = {d.entry_id: d for d in await dead_letters(bus, run_keys.dlq)}
    assert set(letters) == {*poison_ids.values(), no_field}
    for label, raw in poison.items():
        dl = letters[poison_ids[label]]
        assert dl.raw == raw, label
        assert dl.source_stream == stream and dl.group == "trainer" and dl.consumer == "t0"
        assert dl.reason
    assert "newer" in letters[poison_ids["future version"]].reason
    assert "Bogus" in letters[poison_ids["unknown type"]].reason
    assert "unexpected message type Heartbeat" in letters[poison_ids["wrong type"]].reason
    assert "no field" in letters[no_field].reason
    assert c.stats.dead_lettered == 5
    assert await pending_count(bus, stream, "trainer") == 0  # poison was acked


@pytest.mark.asyncio
async def test_max_deliveries_exceeded_goes_to_dlq(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.prompts
    c = Consumer(bus, stream, "rollouter", "r0", max_deliveries=3)
    await c.ensure_group()
    entry = await bus.publish(stream, StepStarted(step=1, param_version=0))
    counts = [d.deliveries for d in await c.read(count=1, block_ms=100)]
    for _ in range(2):  # a handler that keeps failing: never acks, gets it back
        counts += [d.deliveries for d in await c.reclaim(min_idle_ms=0)]
    assert counts == [1, 2, 3]
    assert await c.reclaim(min_idle_ms=0) == []  # 4th delivery > 3: dead-lettered
    [dl] = await dead_letters(bus, run_keys.dlq)
    assert dl.entry_id == entry and dl.deliveries == 4
    assert dl.reason.startswith(EXCEEDED_REASON)
    msg = decode(dl.raw)
    assert isinstance(msg, StepStarted) and msg.step == 1
    assert await pending_count(bus, stream, "rollouter") == 0


@pytest.mark.asyncio
async def test_max_deliveries_on_restarted_member(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.prompts
    first = Consumer(bus, stream, "g", "same", max_deliveries=1)
    await first.ensure_group()
    await bus.publish(stream, StepStarted(step=1, param_version=0))
    assert len(await first.read(count=1, block_ms=100)) == 1
    again = Consumer(bus, stream, "g", "same", max_deliveries=1)
    assert await again.read(count=1, block_ms=None) == []
    assert len(await dead_letters(bus, run_keys.dlq)) == 1


@pytest.mark.asyncio
async def test_handler_can_dead_letter(bus: Bus, run_keys: RunKeys) -> None:
    c = Consumer(bus, run_keys.samples, "trainer", "t0")
    await c.ensure_group()
    await bus.publish(run_keys.samples, StepStarted(step=1, param_version=0))
    [d] = await c.read(count=1, block_ms=100)
    await c.dead_letter(d, "reward model rejected it")
    [dl] = await dead_letters(bus, run_keys.dlq)
    assert dl.reason == "reward model rejected it" and decode(dl.raw).step == 1
    assert c.inflight == 0 and await pending_count(bus, run_keys.samples, "trainer") == 0


def test_default_dlq() -> None:
    assert default_dlq("rlbus:{r1}:samples") == "rlbus:{r1}:dlq"
    assert default_dlq("plain") == "plain:dlq"


# --------------------------------------------------------------------------- trimmed pending


async def _trimmed_pending_case(bus: Bus, keys: RunKeys, via: str) -> None:
    stream = keys.samples
    holder = Consumer(bus, stream, "trainer", "holder")
    await holder.ensure_group()
    await bus.publish_many(stream, steps(4))
    held = await holder.read(count=4, block_ms=100)
    assert len(held) == 4
    # Entries 0 and 1 vanish while pending (XDEL here; XTRIM MAXLEN acts the same).
    await bus.command("XDEL", stream, held[0].id, held[1].id)
    if via == "reclaim":
        other = Consumer(bus, stream, "trainer", "other")
        got = await other.reclaim(min_idle_ms=0)
        stats = other.stats
    else:
        restarted = Consumer(bus, stream, "trainer", "holder")
        got = await restarted.read(count=10, block_ms=None)
        stats = restarted.stats
    assert [d.id for d in got] == [held[2].id, held[3].id]
    assert stats.trimmed == 2
    letters = await dead_letters(bus, keys.dlq)
    assert sorted(dl.entry_id for dl in letters) == [held[0].id, held[1].id]
    assert all(dl.reason == TRIMMED_REASON and dl.raw == b"" for dl in letters)
    # Cleaned from the PEL: only the two live entries remain pending.
    assert await pending_count(bus, stream, "trainer") == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["reclaim", "own-pending"])
async def test_trimmed_pending_entries_default_server(
    bus: Bus, run_keys: RunKeys, via: str
) -> None:
    await _trimmed_pending_case(bus, run_keys, via)


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["reclaim", "own-pending"])
async def test_trimmed_pending_entries_redis7(
    redis7_server: EmbeddedRedis,
    make_bus: Callable[..., Awaitable[Bus]],
    run_keys: RunKeys,
    via: str,
) -> None:
    # Redis 7 reports deleted ids in XAUTOCLAIM's third element (6.2 returns nil entries).
    bus = await make_bus(redis7_server.url)
    assert (await bus.server_version())[0] >= 7
    await _trimmed_pending_case(bus, run_keys, via)


# --------------------------------------------------------------------------- trimming


@pytest.mark.asyncio
async def test_trim_safely_keeps_pending_and_undelivered(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.samples
    ids = await bus.publish_many(stream, steps(20))
    done = Consumer(bus, stream, "done", "d")
    slow = Consumer(bus, stream, "slow", "s")
    await done.ensure_group()
    await slow.ensure_group()
    await done.ack(*await done.read(count=20, block_ms=100))
    got = await slow.read(count=10, block_ms=100)
    await slow.ack(*got[:3], *got[5:])  # entries 3 and 4 stay pending; 10.. undelivered
    assert await bus.trim_safely(stream, maxlen=0) == 3
    remaining = [e.id async for e in bus.read_all(stream)]
    assert remaining == ids[3:]
    await slow.ack(*got[3:5])
    assert await bus.trim_safely(stream, minid=ids[15]) == 7  # floor: first undelivered (10)
    assert [e.id async for e in bus.read_all(stream)] == ids[10:]
    await slow.ack(*await slow.read(count=20, block_ms=100))
    assert await bus.trim_safely(stream, maxlen=4) == 6
    assert [e.id async for e in bus.read_all(stream)] == ids[16:]
    assert await bus.trim_safely(run_keys.control, maxlen=0) == 0  # missing stream
    with pytest.raises(ValueError):
        await bus.trim_safely(stream)


@pytest.mark.asyncio
async def test_trim_safely_without_groups_trims_as_asked(bus: Bus, run_keys: RunKeys) -> None:
    ids = await bus.publish_many(run_keys.events, steps(10))
    assert await bus.trim_safely(run_keys.events, maxlen=3) == 7
    assert [e.id async for e in bus.read_all(run_keys.events)] == ids[7:]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    n=st.integers(1, 40),
    groups=st.lists(
        st.tuples(st.integers(0, 40), st.sets(st.integers(0, 39))), min_size=0, max_size=3
    ),
    maxlen=st.integers(0, 45),
)
def test_trim_safely_property(
    redis_url: str, n: int, groups: list[tuple[int, set[int]]], maxlen: int
) -> None:
    """For any group progress, trimming removes exactly the entries before the safe floor
    (or before the maxlen cut, whichever is older) and never a pending/undelivered one."""

    async def check() -> None:
        async with Bus.from_url(redis_url) as bus:
            keys = RunKeys(f"p-{os.urandom(6).hex()}")
            ids = await bus.publish_many(keys.samples, steps(n))
            unsafe: set[int] = set()
            for g, (delivered, acked) in enumerate(groups):
                delivered = min(delivered, n)
                c = Consumer(bus, keys.samples, f"g{g}", "c")
                await c.ensure_group()
                got = await c.read(count=delivered, block_ms=None) if delivered else []
                await c.ack(*(d.id for i, d in enumerate(got) if i in acked))
                unsafe |= {i for i in range(delivered) if i not in acked}
                unsafe |= set(range(delivered, n))
            floor = min(unsafe) if unsafe else n
            if not groups:
                floor = n
            expected_removed = min(max(0, n - maxlen), floor)
            removed = await bus.trim_safely(keys.samples, maxlen=maxlen)
            assert removed == expected_removed
            left = [e.id async for e in bus.read_all(keys.samples)]
            assert left == ids[expected_removed:]
            await bus.delete(keys.samples)

    asyncio.run(check())


# --------------------------------------------------------------------------- gone


@pytest.mark.asyncio
async def test_destroyed_group_is_a_clear_error(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.samples
    c = Consumer(bus, stream, "trainer", "t0")
    await c.ensure_group()
    await bus.publish(stream, StepStarted(step=1, param_version=0))
    assert await bus.destroy_group(stream, "trainer") is True
    for call in (lambda: c.read(count=1, block_ms=100), lambda: c.reclaim(min_idle_ms=0)):
        with pytest.raises(GroupGone) as info:
            async with asyncio.timeout(5):
                await call()
        assert info.value.stream == stream and info.value.group == "trainer"
        assert "trainer" in str(info.value) and stream in str(info.value)


@pytest.mark.asyncio
async def test_deleted_stream_is_a_clear_error(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.samples
    c = Consumer(bus, stream, "trainer", "t0")
    await c.ensure_group()
    await bus.delete(stream)
    with pytest.raises(StreamGone) as info:
        async with asyncio.timeout(5):
            await c.read(count=1, block_ms=100)
    assert stream in str(info.value) and "trainer" in str(info.value)
    # Also under a reader that may be blocked: Redis 7 unblocks it with NOGROUP, 6.2 lets the
    # block time out; either way the reader learns of it by its next read at the latest.
    await c.ensure_group()
    reader = asyncio.create_task(c.read(count=1, block_ms=1000))
    await bus.delete(stream)
    async with asyncio.timeout(10):
        try:
            assert await reader == []
        except StreamGone:
            pass
        else:
            with pytest.raises(StreamGone):
                await c.read(count=1, block_ms=100)


# --------------------------------------------------------------------------- outages


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_survives_redis_restart(
    redis_factory: Callable[..., EmbeddedRedis], run_keys: RunKeys
) -> None:
    server = redis_factory(appendonly=True)
    port = server.port
    async with Bus.from_url(server.url) as bus:
        c = Consumer(bus, run_keys.samples, "trainer", "t0")
        await c.ensure_group()
        await bus.publish_many(run_keys.samples, steps(3))
        held = await c.read(count=1, block_ms=100)
        server.stop()
        # The next publish succeeds once the server is back (within the retry bound).
        failed_once = asyncio.Event()
        bus.on_retry = lambda op, attempt, exc: failed_once.set()
        publish = asyncio.create_task(bus.publish(run_keys.samples, steps(1, start=3)[0]))
        async with asyncio.timeout(10):
            await failed_once.wait()
        await asyncio.to_thread(server.start)
        async with asyncio.timeout(15):
            await publish
        assert server.port == port
        # State survived (AOF): the group, its pending entry and all entries.
        assert await bus.length(run_keys.samples) == 4
        again = Consumer(bus, run_keys.samples, "trainer", "t0")
        back = await again.read(count=10, block_ms=100)
        assert [d.id for d in back] == [d.id for d in held]
        rest = await read_until(again, 3)
        assert [d.msg.step for d in rest] == [1, 2, 3]


@pytest.mark.asyncio
async def test_unavailable_names_url_without_password(
    redis_factory: Callable[..., EmbeddedRedis], make_bus: Callable[..., Awaitable[Bus]]
) -> None:
    server = redis_factory(password="s3cret-pw")
    bus = await make_bus(server.url, retry=FAST_FAIL)
    await bus.ping()
    server.stop()
    with pytest.raises(BusUnavailable) as info:
        async with asyncio.timeout(10):
            await bus.publish("s", StepStarted(step=1, param_version=0))
    text = str(info.value)
    assert f"redis://:***@127.0.0.1:{server.port}/0" in text
    assert "s3cret-pw" not in text and info.value.attempts == 3
    assert "XADD" in text


@pytest.mark.asyncio
async def test_consumer_read_unavailable(
    redis_factory: Callable[..., EmbeddedRedis], make_bus: Callable[..., Awaitable[Bus]]
) -> None:
    server = redis_factory()
    bus = await make_bus(server.url, retry=FAST_FAIL)
    c = Consumer(bus, "s", "g", "c")
    await c.ensure_group()
    server.kill()
    with pytest.raises(BusUnavailable, match=f"127.0.0.1:{server.port}"):
        async with asyncio.timeout(10):
            await c.read(count=1, block_ms=100)


@pytest.mark.asyncio
async def test_wrong_password_is_not_retried(
    redis_factory: Callable[..., EmbeddedRedis], make_bus: Callable[..., Awaitable[Bus]]
) -> None:
    server = redis_factory(password="right")
    bus = await make_bus(f"redis://:wrong@127.0.0.1:{server.port}/0")
    with pytest.raises(BusAuthError) as info:
        async with asyncio.timeout(5):
            await bus.ping()
    assert "wrong" not in str(info.value)


@pytest.mark.asyncio
async def test_reclaim_from_takes_only_the_named_members_entries(bus: Bus, run_id: str) -> None:
    """A slow but live member keeps its work; a gone member's entries move at once, however
    recently delivered; one trimmed while pending is dead-lettered with the reason."""
    from runschema.messages import RunFinished

    stream = f"rlbus:{{{run_id}}}:reclaim"
    dead = Consumer(bus, stream, "g", "dead")
    slow = Consumer(bus, stream, "g", "slow")
    taker = Consumer(bus, stream, "g", "taker")
    await dead.ensure_group()
    for i in range(6):
        await bus.publish(stream, RunFinished(run_id="x", steps=i))
    got_dead = await dead.read(count=3, block_ms=10)
    got_slow = await slow.read(count=3, block_ms=10)
    assert sorted(await bus.consumers(stream, "g")) == ["dead", "slow"]
    await bus.command("XDEL", stream, got_dead[0].id)
    moved = await taker.reclaim_from(["dead", "taker"])
    assert [d.msg.steps for d in moved] == [1, 2]
    letters = [m async for _, m in bus.read_all(default_dlq(stream))]
    assert len(letters) == 1 and letters[0].reason == TRIMMED_REASON
    pending = await bus.command("XPENDING", stream, "g", "-", "+", 10)
    owners = {row[0].decode(): row[1].decode() for row in pending}
    assert all(owners[d.id] == "slow" for d in got_slow)
    assert await bus.consumers("nope", "g") == []


@pytest.mark.asyncio
async def test_pending_owners_names_the_member_holding_each_entry(
    bus: Bus, run_keys: RunKeys
) -> None:
    stream = run_keys.prompts
    a = Consumer(bus, stream, "g", "a")
    b = Consumer(bus, stream, "g", "b")
    await a.ensure_group()
    assert await bus.pending_owners(stream, "g", 10) == {}
    await bus.publish_many(stream, steps(5))
    got_a = await a.read(count=2, block_ms=10)
    got_b = await b.read(count=3, block_ms=10)
    assert (len(got_a), len(got_b)) == (2, 3)
    owners = await bus.pending_owners(stream, "g", 10)
    assert owners == {**{d.id: "a" for d in got_a}, **{d.id: "b" for d in got_b}}
    # count bounds the reply to the oldest pending entries; an acked entry is not pending.
    assert await bus.pending_owners(stream, "g", 3) == {
        d.id: owner for d, owner in [(got_a[0], "a"), (got_a[1], "a"), (got_b[0], "b")]
    }
    await b.ack(got_b[0])
    assert got_b[0].id not in await bus.pending_owners(stream, "g", 10)
    with pytest.raises(GroupGone):
        await bus.pending_owners(stream, "nope", 10)
    with pytest.raises(StreamGone):
        await bus.pending_owners(f"{stream}:missing", "g", 10)


@pytest.mark.asyncio
async def test_groups_lists_each_group_with_its_counts(bus: Bus, run_keys: RunKeys) -> None:
    stream = run_keys.samples
    assert await bus.groups(stream) == []  # no stream yet
    busy = Consumer(bus, stream, "busy", "m")
    idle = Consumer(bus, stream, "idle", "m")
    await busy.ensure_group()
    await idle.ensure_group()
    ids = await bus.publish_many(stream, steps(3))
    await busy.read(count=2, block_ms=10)
    infos = {g.name: g for g in await bus.groups(stream)}
    assert set(infos) == {"busy", "idle"}
    assert (infos["busy"].consumers, infos["busy"].pending) == (1, 2)
    assert infos["busy"].last_delivered_id == ids[1]
    assert (infos["idle"].consumers, infos["idle"].pending) == (0, 0)
    assert infos["idle"].last_delivered_id == "0-0"
    assert await bus.consumers(stream, "busy") == ["m"]
