"""The collective weight transport (weights.collective): rounds planned from the live
receivers, bytes broadcast over gloo, every chunk checked; receivers are real processes
against the test's redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from bus import BlobCorrupt, Bus, BusOutOfMemory, RunKeys, pulse_forever
from runschema.messages import (
    BlobRef,
    Heartbeat,
    Sample,
    StepFinished,
    WarningRaised,
    WeightsPublished,
)
from tests.procs import Procs, assert_every_step_once, events_of, run_args
from tests.waits import event, wait_for, wait_until
from weights import collective_round
from weights.collective import Broadcaster, Receiver, invite, still_live, still_silent
from weights.collective_round import ChunkCheck, Member, RoundPlan, flatten
from weights.transport import RedisTransport, TransportUnreachable, chunk_digests, flat_buffer

CHUNK = 64 * 1024  # many chunks, and pieces of several chunks


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=g)
    return {"emb.weight": w, "head.weight": w,  # tied: one object, sent once
            "norm": torch.randn(200, generator=g).to(torch.bfloat16),
            "steps": torch.arange(7, dtype=torch.int64), "empty": torch.empty(0, 3)}


def _summary(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], str]]:
    return {k: (str(v.dtype), list(v.shape), hashlib.sha256(
        v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
        for k, v in state.items()}


# ---------------------------------------------------------------------- chunks checked as they come


@given(st.binary(max_size=5000), st.integers(1, 700))
def test_chunk_digests_are_each_chunks_sha256(data: bytes, chunk: int) -> None:
    want = [hashlib.sha256(data[i:i + chunk]).digest() for i in range(0, len(data), chunk)]
    assert chunk_digests(memoryview(data), chunk) == want


@given(st.lists(st.integers(0, 250_000), max_size=6), st.integers(2000, 70_000))
def test_a_received_buffer_is_checked_piece_by_piece_and_a_bad_chunk_is_named(
    ends: list[int], chunk: int
) -> None:
    buf, m = flatten(_state(), chunk)
    copy = flat_buffer(m.size)
    copy[:] = buf
    check = ChunkCheck(m, copy, "w")
    for end in sorted(ends):  # pieces in any sizes, then the whole
        check(min(end, m.size))
    check(m.size)
    assert check.checked == len(m.chunks)
    bad = m.size // 2
    copy[bad] ^= 0xFF
    fresh = ChunkCheck(m, copy, "w")
    fresh(bad // chunk * chunk)  # the chunks before the bad one are fine
    with pytest.raises(BlobCorrupt, match=f"chunk {bad // chunk} as broadcast"):
        fresh(m.size)


# ---------------------------------------------------------------------- planning (pure)

members = st.builds(Member, st.integers(0, 5), st.integers(1, 4))


@given(st.lists(members), st.dictionaries(members, st.sampled_from(["a", "b"])),
       st.sampled_from(["a", "b"]))
def test_a_round_invites_exactly_the_live_receivers_without_the_newest(
    live: list[Member], delivered: dict[Member, str], key: str
) -> None:
    invited = invite(live, delivered, key)
    assert set(invited) == {m for m in live if delivered.get(m) != key}
    assert invited == sorted(set(invited), key=lambda m: (m.rank, m.pid))
    kept = still_live(delivered, live)
    assert set(kept) <= set(live) and all(kept[m] == delivered[m] for m in kept)


# ---------------------------------------------------------------------- receivers

async def _receive(url: str, run_id: str, rank: int, conn: Connection) -> None:
    keys = RunKeys(run_id)
    async with Bus.from_url(url) as bus:
        receiver = Receiver(bus, keys, Member(rank, os.getpid()), poll_s=0.05)
        beat = asyncio.create_task(pulse_forever(
            bus, keys.alive("rollouter", rank),
            lambda: Heartbeat(role="rollouter", rank=rank, pid=os.getpid(),
                              weights_receiver=True), 0.2, 1.5))
        task = asyncio.create_task(receiver.run())
        conn.send("up")
        while True:
            asked = await asyncio.to_thread(conn.recv)
            if asked is None:
                break
            ref = msgspec.convert(asked, BlobRef)
            try:
                conn.send(_summary(await receiver.take(ref, wait_s=8)))
            except TransportUnreachable as exc:
                conn.send(str(exc))
        task.cancel()
        beat.cancel()


def _receiver_main(url: str, run_id: str, rank: int, conn: Connection) -> None:
    asyncio.run(_receive(url, run_id, rank, conn))


class _Receivers:
    """Receiver processes by rank; ``ask`` hands each a reference and returns what it got."""

    def __init__(self, url: str, run_id: str) -> None:
        self.url, self.run_id = url, run_id
        self.ctx = mp.get_context("spawn")
        self.procs: dict[int, Any] = {}
        self.pipes: dict[int, Connection] = {}

    async def start(self, rank: int, target: Callable[..., None] = _receiver_main,
                    extra: tuple[Any, ...] = ()) -> None:
        mine, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(self.url, self.run_id, rank, theirs, *extra),
                             daemon=True)
        p.start()
        self.procs[rank], self.pipes[rank] = p, mine
        assert await asyncio.to_thread(mine.poll, 120), f"receiver {rank} did not start"
        assert mine.recv() == "up"

    async def ask(self, ref: BlobRef, *ranks: int) -> dict[int, Any]:
        for rank in ranks:
            self.pipes[rank].send(msgspec.to_builtins(ref))
        out = {}
        for rank in ranks:
            assert await asyncio.to_thread(self.pipes[rank].poll, 60), f"{rank} said nothing"
            out[rank] = self.pipes[rank].recv()
        return out

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(10)

    def stop(self) -> None:
        for rank, p in self.procs.items():
            if p.is_alive():
                self.pipes[rank].send(None)
                p.join(10)
            if p.is_alive():
                p.kill()


async def _seen(b: Broadcaster, ranks: set[int]) -> None:
    """Until the broadcaster sees exactly ``ranks`` as live receivers (their first pulse, or
    a dead one's liveness key lapsed)."""

    async def seen() -> bool | None:
        return True if {m.rank for m in await b.receivers()} == ranks else None

    await wait_until(seen, f"exactly receivers {sorted(ranks)} live", 120)


async def _serve_until(b: Broadcaster, ranks: set[int], timeout_s: float = 60) -> None:
    """Rounds until every rank in ``ranks`` holds the newest publication."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while {m.rank for m, key in b.delivered.items()
           if b.latest is not None and key == b.latest.ref.key} != ranks:
        assert loop.time() < deadline, f"not served: {ranks}, delivered {b.delivered}"
        await b.serve()
        await asyncio.sleep(0.1)


@pytest.mark.procs  # three receiver processes, each importing torch: 13-30 s
@pytest.mark.asyncio
async def test_broadcast_rounds_give_every_receiver_what_redis_gives_joiners_included(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys
) -> None:
    told: list[str] = []

    async def warn(text: str) -> None:
        told.append(text)

    b = Broadcaster(bus, run_keys, epoch="e1", host="127.0.0.1", timeout_s=20,
                    join_timeout_s=5, chunk_size=CHUNK, warn=warn)
    expected = _summary(await RedisTransport(bus, run_keys, chunk_size=CHUNK).fetch(
        await RedisTransport(bus, run_keys, chunk_size=CHUNK).publish("weights-r", _state())))
    receivers = _Receivers(redis_url, run_id)
    try:
        await receivers.start(0)
        await receivers.start(1)
        await _seen(b, {0, 1})
        ref = await b.publish("weights-v1-e1", _state(), 1)
        await _serve_until(b, {0, 1})
        assert await receivers.ask(ref, 0, 1) == {0: expected, 1: expected}
        assert b.rounds == 1  # both in one round
        # A newer publication goes to both in one more round; a joiner gets it in its own.
        state2 = {k: v + 1 if v.is_floating_point() else v for k, v in _state().items()}
        ref2 = await b.publish("weights-v2-e1", state2, 2)
        await _serve_until(b, {0, 1})
        await receivers.start(2)
        await _seen(b, {0, 1, 2})
        await _serve_until(b, {0, 1, 2})
        assert b.rounds == 3
        got = await receivers.ask(ref2, 0, 1, 2)
        assert got[0] == got[1] == got[2] == _summary(state2)
        assert not told
        # A receiver that died is invited while its liveness key lasts, is left out of the
        # round after the join timeout (the others are served), then no longer invited.
        receivers.kill(1)
        ref3 = await b.publish("weights-v3-e1", _state(), 3)
        served = await b.serve()
        assert {m.rank for m in served} == {0, 2}
        assert told and "did not receive it" in told[0]
        assert (await receivers.ask(ref3, 0))[0] == expected
        await _seen(b, {0, 2})  # once the dead one's liveness key (1.5 s) lapsed
        assert await b.serve() == []  # nobody lacks v3
    finally:
        receivers.stop()


@pytest.mark.asyncio
async def test_a_publication_no_round_brings_is_unreachable_naming_the_last_round(
    bus: Bus, run_keys: RunKeys
) -> None:
    receiver = Receiver(bus, run_keys, Member(0, os.getpid()))
    ref = BlobRef(store="weights:collective", key=run_keys.blob("weights-v4-e"), size=1,
                  sha256="0" * 64, chunks=1)
    with pytest.raises(TransportUnreachable, match=r"within 0.3 s \(last round: no round yet"):
        await receiver.take(ref, wait_s=0.3)


@pytest.mark.asyncio
async def test_a_round_that_cannot_start_is_told_and_tried_again(
    bus: Bus, run_keys: RunKeys
) -> None:
    """The broadcaster's task never dies silently while rollouters wait on it."""
    told: list[str] = []

    async def warn(text: str) -> None:
        told.append(text)

    b = Broadcaster(bus, run_keys, epoch="e", host="127.0.0.1", timeout_s=5, warn=warn)
    calls = 0

    async def serve() -> list[Member]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("no free port\n<a C++ stack>")
        return []

    b.serve = serve  # type: ignore[method-assign]
    task = asyncio.create_task(b.run())
    b.wake.set()
    try:
        await wait_until(lambda: True if calls >= 2 else None, "a second round", 60)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert told == ["weights broadcast round failed to start: no free port; trying again"]


@pytest.mark.asyncio
async def test_what_the_trainers_warning_raises_ends_the_broadcasts_as_is(
    bus: Bus, run_keys: RunKeys
) -> None:
    """The warning is the trainer's own fenced write: refused (the log behind what it wrote,
    a lease taken back), that is the trainer's to act on (start over), never swallowed as
    a round's trouble and retried while the trainer's other parts wait."""

    class MustStartOver(RuntimeError):
        pass

    async def warn(text: str) -> None:
        raise MustStartOver("the lease had lapsed and is ours again")

    b = Broadcaster(bus, run_keys, epoch="e", host="127.0.0.1", timeout_s=5, warn=warn)

    async def serve() -> list[Member]:
        raise RuntimeError("Redis past its retries")

    b.serve = serve  # type: ignore[method-assign]
    b.wake.set()
    with pytest.raises(MustStartOver, match="ours again"):
        async with asyncio.timeout(30):
            await b.run()

    # Redis refusing every write (out of memory) is the trainer's to name, once: not a
    # round's trouble told (a second line, and a warning write refused the same way).
    told: list[str] = []

    async def noted(text: str) -> None:
        told.append(text)

    async def full() -> list[Member]:
        raise BusOutOfMemory("Redis at redis://r is out of memory: used 8M of 8M")

    b = Broadcaster(bus, run_keys, epoch="e", host="127.0.0.1", timeout_s=5, warn=noted)
    b.serve = full  # type: ignore[method-assign]
    b.wake.set()
    with pytest.raises(BusOutOfMemory):
        async with asyncio.timeout(30):
            await b.run()
    assert told == []


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.asyncio
async def test_a_run_syncs_by_broadcast_and_a_restarted_rollouter_rejoins(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """rollout.weights_transport=collective with two rollouters: every publication is a
    broadcast; rollouter1 killed mid-run and started again (same rank, a new process) is
    served the newest weights in a round of its own and generates; every step so far once,
    no sample trained twice, no fetch warning. The run is long (its end is not awaited), so
    that the restarted rollouter has work whatever the machine's speed."""
    args = run_args(redis_url, run_id, tmp_path, "trainer.total_training_steps=100000",
                    "rollout.replicas=2", "heartbeat.timeout_s=4",
                    "rollout.weights_transport=collective")
    procs.spawn("trainer", "trainer", *args)
    procs.spawn("rollouter0", "rollouter", *args, "rollout.rank=0")
    procs.spawn("rollouter1", "rollouter", *args, "rollout.rank=1")
    await wait_for(bus, run_keys.events, event(StepFinished, step=2), 180,
                   procs.watch("trainer", "rollouter0"))
    procs.kill("rollouter1", signal.SIGKILL)
    restarted = time.time()
    procs.spawn("rollouter1b", "rollouter", *args, "rollout.rank=1")
    # The new rollouter1 generates, so it was served weights by broadcast.
    await wait_for(bus, run_keys.samples,
                   lambda m: isinstance(m, Sample) and m.rank == 1 and m.ts > restarted, 180,
                   procs.watch("trainer", "rollouter0", "rollouter1b"))
    procs.kill("trainer", signal.SIGKILL)
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, max(e.step for e in events if isinstance(e, StepFinished)))
    published = [e for e in events if isinstance(e, WeightsPublished)]
    assert len(published) >= 3 and {e.ref.store for e in published} == {"weights:collective"}
    assert not [e for e in events if isinstance(e, WarningRaised)
                and e.code in ("weights_unreachable", "weights_unloadable")]


# ---------------------------------------------------------------------- a member gone mid-round


@given(st.lists(st.tuples(st.floats(0, 3), st.booleans()), min_size=1, max_size=30),
       st.floats(0.5, 6))
def test_a_member_is_silent_exactly_when_its_pulse_stood_still_for_silent_s(
    looks: list[tuple[float, bool]], silent_s: float
) -> None:
    """Looked at after each gap, pulsing or not in it: silent iff the count has not moved
    since a look at least ``silent_s`` ago (the first look starts the clock)."""
    seen: dict[int, tuple[int, float]] = {}
    now, count, since = 0.0, 0, 0.0
    for i, (gap, pulsed) in enumerate(looks):
        now += gap
        if pulsed:
            count += 1
        if i == 0 or pulsed:
            since = now
        seen, quiet = collective_round.silent(seen, {7: count}, now, silent_s)
        assert quiet == ([7] if now - since >= silent_s else [])


def test_a_dropped_member_is_invited_again_once_its_heartbeat_moves_and_never_while_gone(
) -> None:
    a, b, c = Member(0, 10), Member(1, 11), Member(2, 12)
    silent = {a: 5.0, b: 5.0, c: 5.0}
    assert still_silent(silent, {a: 5.0, b: 6.5}) == {a: 5.0}  # b pulsed, c is gone


def _pieces_main(url: str, run_id: str, rank: int, conn: Connection, piece: int,
                 fault: int | None) -> None:
    """:func:`_receiver_main` with broadcasts of ``piece`` bytes a call (the trainer's side
    must use the same), whose receiver sends itself ``fault`` (if any) once, in its first
    round, when two pieces are in and the third is in flight."""
    collective_round.PIECE = piece
    check = collective_round.ChunkCheck.__call__
    fired: list[int] = []

    def checked(self: ChunkCheck, end: int) -> None:
        check(self, end)
        if fault is not None and not fired and 2 * piece <= end < self.m.size:
            fired.append(end)
            os.kill(os.getpid(), fault)

    collective_round.ChunkCheck.__call__ = checked  # type: ignore[method-assign]
    asyncio.run(_receive(url, run_id, rank, conn))


@pytest.mark.procs  # three receiver processes, each importing torch: 13-30 s
@pytest.mark.asyncio
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "paused"])
async def test_a_member_killed_or_paused_mid_broadcast_is_dropped_and_the_others_served(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, monkeypatch: pytest.MonkeyPatch,
    fault: int
) -> None:
    """Rank 2 dies (or stops) with the bytes half sent. Gloo's timeout is an hour, so the
    others are served only if the round is dropped for rank 2's silence and served again
    without it; a paused member that wakes is served in a round of its own."""
    piece = 2 * CHUNK
    monkeypatch.setattr(collective_round, "PIECE", piece)
    told: list[str] = []

    async def warn(text: str) -> None:
        told.append(text)

    b = Broadcaster(bus, run_keys, epoch="e1", host="127.0.0.1", timeout_s=3600,
                    join_timeout_s=5, chunk_size=CHUNK, warn=warn)
    state = {"w": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(5))}
    receivers = _Receivers(redis_url, run_id)
    try:
        for rank in range(3):
            await receivers.start(rank, target=_pieces_main,
                                  extra=(piece, fault if rank == 2 else None))
        await _seen(b, {0, 1, 2})
        ref = await b.publish("weights-v1-e1", state, 1)
        await _serve_until(b, {0, 1}, timeout_s=120)
        assert {m.rank for m in b.delivered} == {0, 1}
        assert any("rank 2 went silent" in t for t in told), told
        assert await receivers.ask(ref, 0, 1) == {0: _summary(state), 1: _summary(state)}
        if fault == signal.SIGSTOP:
            os.kill(receivers.procs[2].pid, signal.SIGCONT)
            await _serve_until(b, {0, 1, 2}, timeout_s=120)
            assert (await receivers.ask(ref, 2))[2] == _summary(state)
        else:
            await _seen(b, {0, 1})  # its liveness key lapsed: never invited again
            assert await b.serve() == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(receivers.procs[2].pid, signal.SIGCONT)
        receivers.stop()


def _store_main(conn: Connection) -> None:
    """A trainer's round store (and nothing else), until killed."""
    store = collective_round.open_store(60, threading.Event())
    conn.send(store.port)
    time.sleep(3600)


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["before-answering", "after-ready"])
async def test_a_round_whose_trainer_is_paused_is_left_within_seconds(
    bus: Bus, run_keys: RunKeys, when: str
) -> None:
    """A trainer SIGSTOPped while it runs a round (a zombie, a paused VM) holds its store's
    port open and answers nothing, and torch's store client waits for it without bound:
    before its first answer (a socket that accepts and never answers) or after the receiver
    said ready (a real store, stopped). The receiver gives the round up within seconds, not
    at gloo's hour, and counts its end as a try (a fetch's bound restarts there)."""
    b = Broadcaster(bus, run_keys, epoch="z", host="127.0.0.1", timeout_s=3600)
    ref = await b.publish("weights-v1-z", _state(), 1)
    me = Member(0, os.getpid())
    with contextlib.ExitStack() as stack:
        if when == "before-answering":
            paused = stack.enter_context(socket.socket())
            paused.bind(("127.0.0.1", 0))
            paused.listen(8)
            port = paused.getsockname()[1]
        else:
            mine, theirs = mp.get_context("spawn").Pipe()
            trainer = mp.get_context("spawn").Process(target=_store_main, args=(theirs,),
                                                      daemon=True)
            trainer.start()
            stack.callback(trainer.kill)
            stack.callback(lambda: os.kill(trainer.pid, signal.SIGCONT))
            assert await asyncio.to_thread(mine.poll, 120), "the store did not start"
            port = mine.recv()
        plan = RoundPlan(round="z/1", key=ref.key, sha256=ref.sha256, size=ref.size,
                         chunks=ref.chunks, version=1, host="127.0.0.1", port=port,
                         members=[me], join_timeout_s=5, timeout_s=3600)
        await bus.command("SET", run_keys.weights_round, msgspec.msgpack.encode(plan))
        receiver = Receiver(bus, run_keys, me, poll_s=0.05)
        task = asyncio.create_task(receiver.run())
        try:
            if when == "after-ready":
                watcher = dist.TCPStore("127.0.0.1", port, is_master=False,
                                        wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=30))
                await wait_until(lambda: True if watcher.check(["ready/1"]) else None,
                                 "the receiver's ready", 60)
                os.kill(trainer.pid, signal.SIGSTOP)
            await wait_until(lambda: True if receiver.rounds == 2 else None,
                             "the paused trainer's round given up", 120)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert receiver.outcome.startswith("round z/1 (v1) failed: the trainer's round store"), (
        receiver.outcome)
    assert receiver.receiving is None
