"""Ranks claimed on the bus (bus.ranks) against a real redis-server: the lowest free rank,
an explicit rank, a held rank refused, a lapsed rank taken again, only the holder extends
or releases; and the rollouter's ACL user may do all of it, the other roles may not. The
joining policy (runtime.ranks): a gone local holder is replaced at once, a live one refuses
(exit 2), a silent remote one is replaced once its claim lapsed; a component whose rank was
taken exits 1."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import NoPermissionError

from bus import Bus, RankClaim, RankHeld, RankLost, RunKeys, claim_lowest_rank, claim_rank
from runconfig import Config, load_config
from runschema.messages import ComponentFailed
from runtime import Component
from runtime.ranks import RankTaken, join_rank
from tests.compose_redis import AclRedis
from tests.procs import events_of

TTL_S = 30.0
ROLE = "rollouter"


async def _until_free(claim: RankClaim, within_s: float = 10.0) -> None:
    """Wait (bounded) for Redis to expire ``claim``'s key."""
    deadline = time.monotonic() + within_s
    while await claim.holder() is not None:
        assert time.monotonic() < deadline, f"{claim.key} did not expire within {within_s} s"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_the_lowest_free_rank_is_claimed(bus: Bus, run_keys: RunKeys) -> None:
    first = await claim_lowest_rank(bus, run_keys, ROLE, TTL_S, token="a")
    second = await claim_lowest_rank(bus, run_keys, ROLE, TTL_S, token="b")
    third = await claim_lowest_rank(bus, run_keys, ROLE, TTL_S, token="c")
    assert (first.rank, second.rank, third.rank) == (0, 1, 2)
    await second.release()  # a hole: the next joiner fills it
    again = await claim_lowest_rank(bus, run_keys, ROLE, TTL_S, token="d")
    assert again.rank == 1
    assert await bus.command("GET", run_keys.rank_claim(ROLE, 1)) == b"d"
    # A rank claimed explicitly above the others is skipped by the lowest-free search.
    await claim_rank(bus, run_keys, ROLE, 3, TTL_S, token="e")
    assert (await claim_lowest_rank(bus, run_keys, ROLE, TTL_S, token="f")).rank == 4
    # Another role's ranks are its own.
    assert (await claim_lowest_rank(bus, run_keys, "trainer", TTL_S, token="g")).rank == 0


@pytest.mark.asyncio
async def test_an_explicit_rank_held_by_another_process_is_refused(
    bus: Bus, run_keys: RunKeys
) -> None:
    mine = await claim_rank(bus, run_keys, ROLE, 5, TTL_S)
    assert mine.rank == 5
    assert "@" in mine.token and "/" in mine.token  # PID@HOST/NONCE
    with pytest.raises(RankHeld) as info:
        await claim_rank(bus, run_keys, ROLE, 5, TTL_S)
    assert info.value.rank == 5 and info.value.holder == mine.token
    assert "rank 5" in str(info.value) and mine.token in str(info.value)
    assert 0 < int(await bus.command("PTTL", mine.key)) <= TTL_S * 1000
    # All ranks under the limit held: refused too, not a silent overflow.
    for rank in range(2):
        await claim_rank(bus, RunKeys(run_keys.run_id + "-x"), ROLE, rank, TTL_S)
    with pytest.raises(RankHeld):
        await claim_lowest_rank(bus, RunKeys(run_keys.run_id + "-x"), ROLE, TTL_S, limit=2)


@pytest.mark.asyncio
async def test_a_lapsed_rank_is_claimed_again_and_its_old_holder_lost_it(
    bus: Bus, run_keys: RunKeys
) -> None:
    old = await claim_rank(bus, run_keys, ROLE, 0, 0.05, token="old")
    await _until_free(old)
    new = await claim_lowest_rank(bus, run_keys, ROLE, TTL_S, token="new")
    assert new.rank == 0
    assert not await old.refresh()
    with pytest.raises(RankLost) as info:
        await old.check()
    assert info.value.holder == "new" and "rank 0" in str(info.value)
    assert await new.holder() == "new"


@pytest.mark.asyncio
async def test_a_lapsed_rank_nobody_took_is_kept_by_its_holder(
    bus: Bus, run_keys: RunKeys
) -> None:
    claim = await claim_rank(bus, run_keys, ROLE, 2, 0.05, token="paused")
    await _until_free(claim)
    assert await claim.refresh()
    assert await claim.holder() == "paused"


@pytest.mark.asyncio
async def test_only_the_holder_refreshes_or_releases(bus: Bus, run_keys: RunKeys) -> None:
    mine = await claim_rank(bus, run_keys, ROLE, 0, TTL_S, token="mine")
    other = RankClaim(bus, run_keys, ROLE, 0, "other", 60.0)
    assert not await other.refresh()
    await other.release()
    assert await mine.holder() == "mine"
    assert int(await bus.command("PTTL", mine.key)) <= TTL_S * 1000  # not extended to 60 s
    await bus.command("PEXPIRE", mine.key, 1000)
    assert await mine.refresh()
    assert int(await bus.command("PTTL", mine.key)) > 1000  # extended to the TTL again
    await mine.release()
    assert await mine.holder() is None
    # Free again: an explicit claim succeeds.
    assert (await claim_rank(bus, run_keys, ROLE, 0, TTL_S)).rank == 0


RUN = "ranks-acl"


@pytest.fixture(scope="module")
def acl_server(redis7_binary: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    srv = AclRedis(redis7_binary, tmp_path_factory.mktemp("ranks-acl"), RUN)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.asyncio
async def test_the_rollouter_user_claims_refreshes_and_releases_ranks(
    acl_server: AclRedis,
) -> None:
    keys = RunKeys(RUN)
    bus = Bus.from_url(acl_server.url("rollouter"))
    try:
        first = await claim_lowest_rank(bus, keys, ROLE, TTL_S)
        second = await claim_lowest_rank(bus, keys, ROLE, TTL_S)
        assert (first.rank, second.rank) == (0, 1)
        with pytest.raises(RankHeld):
            await claim_rank(bus, keys, ROLE, 1, TTL_S)
        assert await first.refresh()
        await first.release()
        await second.release()
        assert await first.holder() is None
    finally:
        await bus.close()
    profiler = acl_server.client("profiler")
    try:
        with pytest.raises(NoPermissionError):
            profiler.set(keys.rank_claim(ROLE, 0), "forged", nx=True, px=1000)
    finally:
        profiler.close()


@pytest.mark.asyncio
async def test_a_component_whose_rank_was_taken_exits_1_naming_it(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    """The pulse refreshes the claim; once another process holds the rank (ours lapsed and
    was taken), serve is ended and the component exits 1 with a ComponentFailed naming the
    rank and the new holder."""
    cfg = load_config(overrides=[f"redis.url={redis_url}", f"run.id={run_id}",
                                 f"run.output_dir={tmp_path}", "heartbeat.interval_s=0.05"])

    class Forever(Component):
        role = "rollouter"

        async def serve(self) -> int:
            await asyncio.Event().wait()
            return 0

    component = Forever(cfg, bus, rank=0)
    component.claim = await claim_rank(bus, run_keys, ROLE, 0, TTL_S, token="ours")
    task = asyncio.create_task(component.run())
    await bus.command("SET", run_keys.rank_claim(ROLE, 0), "theirs")  # lapsed, then taken
    await bus.command("SET", run_keys.alive(ROLE, 0), "their pulse")
    async with asyncio.timeout(30):  # bounded: the next pulse (0.05 s) ends it
        assert await task == 1
    # Its last pulse did not overwrite the new holder's liveness key, nor did its exit
    # delete it.
    assert await bus.command("GET", run_keys.alive(ROLE, 0)) == b"their pulse"
    failed = [e for e in await events_of(bus, run_keys.events)
              if isinstance(e, ComponentFailed)]
    assert len(failed) == 1 and failed[0].rank == 0
    assert "lost rollouter rank 0 to theirs" in failed[0].error
    assert await bus.command("GET", run_keys.rank_claim(ROLE, 0)) == b"theirs"


def _join_cfg(redis_url: str, run_id: str, tmp_path: Path, timeout_s: float = 30.0) -> Config:
    return load_config(overrides=[f"redis.url={redis_url}", f"run.id={run_id}",
                                  f"run.output_dir={tmp_path}", "heartbeat.interval_s=0.05",
                                  f"heartbeat.timeout_s={timeout_s}"])


def _dead_pid() -> int:
    """A pid of this host that no process has (a child that exited and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.asyncio
@pytest.mark.parametrize("whose", ["a dead process", "this pid, an earlier incarnation"])
async def test_an_explicit_rank_of_a_gone_local_process_is_taken_at_once(
    whose: str, redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    pid = _dead_pid() if whose == "a dead process" else os.getpid()
    old = f"{pid}@{socket.gethostname()}/0000"
    await bus.command("SET", run_keys.rank_claim(ROLE, 0), old, "PX", 60_000)
    said: list[str] = []
    claim = await join_rank(_join_cfg(redis_url, run_id, tmp_path), bus, ROLE, 0, said.append)
    assert claim.rank == 0 and await claim.holder() == claim.token != old
    assert said == []  # no wait: the holder was known gone


@pytest.mark.asyncio
async def test_an_explicit_rank_whose_holder_extends_it_is_refused(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    cfg = _join_cfg(redis_url, run_id, tmp_path, timeout_s=2.0)
    live = await claim_rank(bus, run_keys, ROLE, 0, 2.0, token="1@elsewhere/live")

    async def pulse() -> None:  # the live holder's pulse
        while True:
            await live.refresh()
            await asyncio.sleep(0.05)

    pulsing = asyncio.create_task(pulse())
    said: list[str] = []
    try:
        with pytest.raises(RankTaken) as info:
            await join_rank(cfg, bus, ROLE, 0, said.append)
    finally:
        pulsing.cancel()
    assert info.value.code == 2 and "1@elsewhere/live" in str(info.value)
    assert len(said) == 1 and "checking whether it is alive" in said[0]
    assert await live.holder() == "1@elsewhere/live"


@pytest.mark.asyncio
async def test_an_explicit_rank_of_a_silent_remote_holder_is_taken_once_it_lapsed(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    cfg = _join_cfg(redis_url, run_id, tmp_path, timeout_s=0.5)
    await claim_rank(bus, run_keys, ROLE, 0, 0.5, token="1@elsewhere/crashed")
    said: list[str] = []
    claim = await join_rank(cfg, bus, ROLE, 0, said.append)
    assert await claim.holder() == claim.token
    assert len(said) == 1 and "1@elsewhere/crashed" in said[0]
