"""A fenced consumer against a real redis-server: a member whose lease was taken cannot
read, ack, dead-letter or claim one entry; the lease's holder adopts what it held."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from bus import (
    TRIMMED_REASON,
    Bus,
    Consumer,
    EntryGone,
    Fenced,
    GroupGone,
    Lease,
    RunKeys,
    Then,
    ThenRead,
)
from rlbus.redis_server import EmbeddedRedis
from runschema.messages import DeadLetter, StepStarted
from tests.waits import wait_until

pytestmark = pytest.mark.asyncio

GROUP = "trainer"


async def _publish(bus: Bus, stream: str, n: int) -> list[str]:
    return [await bus.publish(stream, StepStarted(step=i, param_version=0)) for i in range(n)]


async def _letters(bus: Bus, keys: RunKeys) -> list[DeadLetter]:
    return [m async for _, m in bus.read_all(keys.dlq) if isinstance(m, DeadLetter)]


async def _pending(bus: Bus, keys: RunKeys) -> dict[str, str]:
    return await bus.pending_owners(keys.samples, GROUP, 100)


async def _member(bus: Bus, keys: RunKeys, epoch: str) -> Consumer:
    """A trainer incarnation: its lease (taken from whoever holds it) and its member."""
    lease = Lease(bus, keys.trainer_lease, f"host:1:{epoch}", 30.0)
    holder = await lease.acquire()
    if holder is not None:
        assert await lease.steal(holder)
    return Consumer(bus, keys.samples, GROUP, f"trainer-{epoch}", dlq_stream=keys.dlq,
                    fence=lease)


async def test_a_stale_token_cannot_read_ack_dead_letter_or_claim(
    bus: Bus, run_keys: RunKeys
) -> None:
    ids = await _publish(bus, run_keys.samples, 4)
    old = await _member(bus, run_keys, "a")
    await old.ensure_group()
    held = await old.read(count=2, block_ms=None)
    assert [d.id for d in held] == ids[:2]
    new = await _member(bus, run_keys, "b")  # takes the lease: "a" is a zombie now
    for refused in (lambda: old.read(count=10, block_ms=None),
                    lambda: old.read(count=10, block_ms=100), lambda: old.ack(*held),
                    lambda: old.dead_letter(held[0], "ticket was never issued")):
        with pytest.raises(Fenced):
            await refused()
    # Nothing moved: the zombie's two entries pending on it, the two new ones undelivered.
    assert await _pending(bus, run_keys) == {i: "trainer-a" for i in ids[:2]}
    assert await _letters(bus, run_keys) == []
    assert (await bus.groups(run_keys.samples))[0].last_delivered_id == ids[1]
    # The holder adopts what the zombie held (read first, counted once more) and removes
    # the zombie's member.
    assert await new.adopt() == {"trainer-a": 2}
    assert await bus.consumers(run_keys.samples, GROUP) == ["trainer-b"]
    got = await new.read(count=10, block_ms=None)
    got += await new.read(count=10, block_ms=None)
    assert [(d.id, d.deliveries) for d in got] == [(ids[0], 2), (ids[1], 2), (ids[2], 1),
                                                   (ids[3], 1)]
    # Nor can the zombie claim them back.
    for refused in (lambda: old.reclaim(min_idle_ms=0), lambda: old.reclaim_from(["trainer-b"]),
                    old.adopt):
        with pytest.raises(Fenced):
            await refused()
    assert await _pending(bus, run_keys) == {i: "trainer-b" for i in ids}
    # The holder acks and dead-letters as usual.
    await new.dead_letter(got[0], "invalid")
    assert await new.ack(*got[1:]) == 3
    assert await _pending(bus, run_keys) == {}
    letters = await _letters(bus, run_keys)
    assert [(dl.entry_id, dl.consumer) for dl in letters] == [(ids[0], "trainer-b")]


async def _blocked_on_xread(bus: Bus) -> bool | None:
    """Whether a client of the server is blocked in XREAD (CLIENT LIST: flags=b)."""
    clients = await bus.command("CLIENT", "LIST")
    text = clients.decode() if isinstance(clients, bytes) else str(clients)
    fields = [dict(f.split("=", 1) for f in line.split() if "=" in f)
              for line in text.splitlines()]
    return True if any(c.get("cmd") == "xread" and "b" in c.get("flags", "")
                       for c in fields) else None


async def test_a_fenced_read_waits_for_new_entries(bus: Bus, run_keys: RunKeys) -> None:
    member = await _member(bus, run_keys, "a")
    await member.ensure_group()
    assert await member.read(count=10, block_ms=50) == []
    waiting = asyncio.create_task(member.read(count=10, block_ms=10_000))
    await wait_until(lambda: _blocked_on_xread(bus), "the read's XREAD BLOCK in Redis", 30)
    ids = await _publish(bus, run_keys.samples, 2)
    got = await asyncio.wait_for(waiting, 30)
    got += await member.read(count=10, block_ms=None)
    assert [d.id for d in got] == ids


async def test_a_fenced_member_of_a_destroyed_group_is_told(bus: Bus, run_keys: RunKeys) -> None:
    member = await _member(bus, run_keys, "a")
    await member.ensure_group()
    await bus.destroy_group(run_keys.samples, GROUP)
    with pytest.raises(GroupGone):
        await member.read(count=10, block_ms=None)
    with pytest.raises(GroupGone):
        await member.reclaim(min_idle_ms=0)


async def test_a_fenced_call_requires_its_entry(bus: Bus, run_keys: RunKeys) -> None:
    lease = Lease(bus, run_keys.trainer_lease, "host:1:a", 30.0)
    assert await lease.acquire() is None
    [kept] = await _publish(bus, run_keys.events, 1)
    body = "return redis.call('XLEN', KEYS[3])"
    assert await lease.run_fenced(body, [run_keys.events], [],
                                  require=(run_keys.events, kept)) == 1
    with pytest.raises(EntryGone):
        await lease.run_fenced(body, [run_keys.events], [], require=(run_keys.events, "1-0"))


async def _adopt_trimmed_case(bus: Bus, keys: RunKeys) -> None:
    ids = await _publish(bus, keys.samples, 4)
    old = await _member(bus, keys, "a")
    await old.ensure_group()
    assert len(await old.read(count=4, block_ms=None)) == 4
    await bus.command("XDEL", keys.samples, ids[0], ids[2])  # trimmed while pending
    new = await _member(bus, keys, "b")
    await new.adopt()
    got = await new.read(count=10, block_ms=None)
    assert [d.id for d in got] == [ids[1], ids[3]]
    assert await bus.consumers(keys.samples, GROUP) == ["trainer-b"]
    letters = await _letters(bus, keys)
    assert sorted(dl.entry_id for dl in letters) == [ids[0], ids[2]]
    assert {dl.reason for dl in letters} == {TRIMMED_REASON}
    assert set(await _pending(bus, keys)) == {ids[1], ids[3]}


async def test_adopt_dead_letters_entries_trimmed_while_pending(
    bus: Bus, run_keys: RunKeys
) -> None:
    await _adopt_trimmed_case(bus, run_keys)


async def test_adopt_dead_letters_entries_trimmed_while_pending_redis7(
    redis7_server: EmbeddedRedis, make_bus: Callable[..., Awaitable[Bus]], run_keys: RunKeys
) -> None:
    # Redis 7's XCLAIM drops a deleted entry from the PEL (6.2 claims it, nil fields).
    bus = await make_bus(redis7_server.url)
    assert (await bus.server_version())[0] >= 7
    await _adopt_trimmed_case(bus, run_keys)


async def test_a_read_brings_what_another_stream_held_when_it_delivered(
    bus: Bus, run_keys: RunKeys
) -> None:
    """read_then: the second stream's entries after a position, read in the script that
    delivered the samples (what it held then, not what came after), only when something
    was delivered; a full read says so, and the next one goes on from its cursor."""
    side = run_keys.log("rollouter")
    member = await _member(bus, run_keys, "a")
    await member.ensure_group()
    before = await _publish(bus, side, 3)
    then = Then(side, "0", 2)
    assert await member.read_then(then, count=10, block_ms=None) == ([], None)
    [sample] = await _publish(bus, run_keys.samples, 1)
    got, read = await member.read_then(then, count=10, block_ms=None)
    assert [d.id for d in got] == [sample]
    assert read is not None and read.full
    assert [e.id for e in read.entries] == before[:2] and read.cursor == before[1]
    # Waiting for samples: the read after the wake-up brings the side stream's news,
    # including what came while it waited.
    waiting = asyncio.create_task(
        member.read_then(Then(side, read.cursor, 10), count=10, block_ms=10_000))
    await wait_until(lambda: _blocked_on_xread(bus), "the read's XREAD BLOCK in Redis", 30)
    later = await _publish(bus, side, 1)
    [sample] = await _publish(bus, run_keys.samples, 1)
    got, read = await asyncio.wait_for(waiting, 30)
    assert [d.id for d in got] == [sample]
    assert read is not None and not read.full
    assert [e.id for e in read.entries] == [before[2], *later]
    # Nothing after the position: an empty read at the same position.
    await _publish(bus, run_keys.samples, 1)
    got, read = await member.read_then(Then(side, later[0], 10), count=10, block_ms=None)
    assert len(got) == 1 and read == ThenRead([], later[0], False)
    # Fenced out: neither read is made.
    await _member(bus, run_keys, "b")
    await _publish(bus, run_keys.samples, 1)
    with pytest.raises(Fenced):
        await member.read_then(Then(side, "0", 10), count=10, block_ms=None)
