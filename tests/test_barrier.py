"""The step barrier of a run (``RunKeys.barrier``) against a real redis-server.

``Bus.set_barrier`` only ever raises the key; ``Bus.publish_guarded`` appends a message only
while the barrier is below the message's first step, atomically (one Lua script). Together
they close the window in which the profiler service could grant a runtime request for a step
that a component has already begun (docs/profiling.md, *The step barrier*).
"""

from __future__ import annotations

import asyncio

import pytest

from bus import Bus, RunKeys
from runschema.messages import FIELD, StartProfile, decode


def cmd(first: int, last: int | None = None, request_id: str = "q") -> StartProfile:
    last = first if last is None else last
    return StartProfile(
        session_id=f"r{request_id}-s{first}-{last}",
        roles=["trainer"],
        tool="torch",
        first_step=first,
        last_step=last,
        request_id=request_id,
        ts=1.0,
    )


def test_barrier_key_shares_the_run_hash_tag() -> None:
    keys = RunKeys("run-1")
    assert keys.barrier == "rlbus:{run-1}:barrier"
    assert keys.barrier.split(":")[1] == keys.control.split(":")[1] == "{run-1}"


@pytest.mark.asyncio
async def test_set_barrier_never_lowers(bus: Bus, run_keys: RunKeys) -> None:
    key = run_keys.barrier
    assert await bus.get_barrier(key) == 0  # missing key reads as 0 and is not created
    assert not await bus.exists(key)
    assert await bus.set_barrier(key, 3) == 3
    assert await bus.set_barrier(key, 1) == 3  # lower: ignored, the current value comes back
    assert await bus.set_barrier(key, 3) == 3
    assert await bus.get_barrier(key) == 3
    assert await bus.set_barrier(key, 7) == 7
    assert await bus.get_barrier(key) == 7
    # A plain string key holding an int (readable with redis-cli GET).
    assert await bus.command("GET", key) == b"7"


@pytest.mark.asyncio
async def test_concurrent_set_barrier_ends_at_the_highest(bus: Bus, run_keys: RunKeys) -> None:
    steps = list(range(1, 41))
    await asyncio.gather(*(bus.set_barrier(run_keys.barrier, s) for s in reversed(steps)))
    assert await bus.get_barrier(run_keys.barrier) == 40


@pytest.mark.asyncio
async def test_guarded_publish_lands_below_the_barrier_refused_at_or_after(
    bus: Bus, run_keys: RunKeys
) -> None:
    control, barrier = run_keys.control, run_keys.barrier
    # No barrier yet (0): any step >= 1 is open.
    first = await bus.publish_guarded(control, cmd(1, request_id="a"), barrier, 1)
    assert first is not None

    await bus.set_barrier(barrier, 4)  # the trainer let step 4 begin
    assert await bus.publish_guarded(control, cmd(4, request_id="b"), barrier, 4) is None
    assert await bus.publish_guarded(control, cmd(2, request_id="c"), barrier, 2) is None
    landed = await bus.publish_guarded(control, cmd(5, 6, request_id="d"), barrier, 5)
    assert landed is not None

    # Only the accepted ones are in the stream, as ordinary single-field entries.
    entries = [e async for e in bus.read_all(control)]
    assert [e.id for e in entries] == [first, landed]
    assert [e.msg.request_id for e in entries] == ["a", "d"]
    raw = await bus.command("XRANGE", control, landed, landed)
    assert raw[0][1][0] == FIELD and decode(raw[0][1][1]) == cmd(5, 6, request_id="d")


@pytest.mark.asyncio
async def test_guarded_publish_racing_a_moving_barrier(bus: Bus, run_keys: RunKeys) -> None:
    """Guarded publishes racing barrier moves (two connections): exactly the accepted ones
    are in the stream, and none can land once the barrier reached its step."""
    control, barrier = run_keys.control, run_keys.barrier

    async def trainer() -> None:
        for k in range(1, 31):
            await bus.set_barrier(barrier, k)
            await asyncio.sleep(0)

    async def service() -> list[tuple[int, str | None]]:
        out = []
        for k in range(1, 31):
            out.append((k, await bus.publish_guarded(control, cmd(k, request_id=f"q{k}"),
                                                     barrier, k)))
        return out

    _, results = await asyncio.gather(trainer(), service())
    accepted = {k for k, eid in results if eid is not None}
    entries = [e async for e in bus.read_all(control)]
    assert {e.msg.first_step for e in entries} == accepted
    assert await bus.get_barrier(barrier) == 30
    # Nothing can land once the barrier has reached a step.
    assert await bus.publish_guarded(control, cmd(30, request_id="late"), barrier, 30) is None
