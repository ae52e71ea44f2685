"""The collective weight transport (``rollout.weights_transport: collective``): the manifest
in Redis, the bytes broadcast from the trainer to the rollouters over gloo, in rounds.

A broadcast needs every member of its group in every call, while rollouters skip superseded
publications, join late, restart and die. So the trainer broadcasts in **rounds**, each with
a group of its own, formed for the publication it sends and the receivers that lack it:

1. The trainer's :class:`Broadcaster` holds the newest publication as one flat buffer; its
   manifest is in Redis at ``KEY:m`` (SADD to the run's blobs set, as the Redis transport
   does), and the ``WeightsPublished`` event names it: the event stays the single source
   of truth.
2. At each publication, and every :data:`POLL_S`, it reads the live rollouters whose
   heartbeat says ``weights_receiver`` and invites those that do not hold the newest
   publication (:func:`invite`, pure).
3. A round: a fresh TCPStore on a free port, and a :class:`RoundPlan` in the run's
   ``weights-round`` key (SET PX) naming the publication, the store and the invited. Every
   invited :class:`Receiver` (it polls that key) reads the manifest and says ``ready/I`` in
   the store. After ``join_timeout_s`` at most, the trainer writes ``go``: who is in. A slow
   receiver is left out of this round only, never out of the run; the next round invites it
   again. Those in form a gloo group and receive the bytes in pieces of up to
   :data:`PIECE` straight into one buffer, check every chunk's sha256 against the manifest,
   and say ``ok/I``. Those who said ok hold the publication.
4. :meth:`Receiver.take` hands a received publication to the rollouter (which asks only for
   the newest it has read in the log); none after ``wait_s`` is
   :class:`~weights.transport.TransportUnreachable`, naming the last round's outcome, so
   the rollouter's fetch warns at once and fails after ``rollout.weights_fetch_timeout_s``.

A member that dies or is paused in a round is dropped from it within seconds: while the bytes
flow every member pulses in the round's store and the trainer watches, and one silent for
``silent_s`` (:data:`~weights.collective_round.SILENT_S`) or gone with an error ends the round
for all; the others are invited again at once, and the silent one is left out of the rounds
until its heartbeat moves (a paused one that wakes is served again; a dead one's liveness key
lapses). A member that dies before the bytes flow fails the group's forming (after the join
timeout) or is left out for not saying ready. A receiver never gives up on a
publication while rounds keep inviting it (:attr:`Receiver.rounds`, which the rollouter's
fetch bound counts from): the trainer is alive and trying. A new trainer (a resume) starts with
nobody served and publishes at start, so every receiver is served again. The round key is a
plain SET, not a fenced write: a zombie trainer's round can only hand receivers a
publication that no event names (its events are fenced), which nobody asks for, and delay
the live trainer's round (whose invited then come in the next one). Memory: the trainer
holds one copy of the newest publication, a receiver the newest one received until the
rollouter takes it. The blocking parts (TCPStore, gloo; :mod:`weights.collective_round`) run on a
daemon thread per side (:class:`~weights.collective_round.Worker`) whose waits look at a stop flag:
a stopping process waits at most :data:`STOP_WAIT_S` for a round in flight. One caveat: a
round stopped or dropped while a peer hangs mid-broadcast leaves a gloo operation pending
(gloo cannot cancel one): the group and its buffer are kept until the operation fails by
gloo's timeout (a receiver holds that round's buffer beside the next round's meanwhile); a
process exiting meanwhile does not wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

import msgspec
import torch

from bus import (
    BlobError,
    BlobNotFound,
    Bus,
    BusAuthError,
    BusRefusedWrite,
    BusUnavailable,
    RunKeys,
    peers,
)
from runschema.messages import BlobRef
from weights.collective_round import (
    CONNECT_S,
    SILENT_S,
    STORE,
    Member,
    RoundClock,
    RoundDropped,
    RoundPlan,
    Worker,
    first_line,
    flatten,
    open_store,
    receive_round,
    send_round,
)
from weights.transport import (
    CHUNK_SIZE,
    Manifest,
    TransportUnreachable,
    WeightsFetcher,
    WeightsPublisher,
    _tensors,
    decode_manifest,
    encode_manifest,
)

__all__ = ["JOIN_TIMEOUT_S", "POLL_S", "Broadcaster", "Receiver", "delete_manifest", "invite",
           "still_live", "still_silent"]

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the trainer looks for receivers that lack the newest publication."""

JOIN_TIMEOUT_S = 10.0
"""How long a round waits for the invited to say ready before it goes on without the rest."""

_RECEIVER_POLL_S = 0.1

_ANSWER_MARGIN_S = 5.0
"""Beyond connecting and the join timeout, how long a round's store may take to answer a
receiver before the round is given up."""

_PLAN_ENCODER = msgspec.msgpack.Encoder()
_PLAN_DECODER = msgspec.msgpack.Decoder(RoundPlan)


def invite(live: Iterable[Member], delivered: Mapping[Member, str], key: str) -> list[Member]:
    """The live receivers that do not hold publication ``key``, in rank order (pure)."""
    return sorted({m for m in live if delivered.get(m) != key}, key=lambda m: (m.rank, m.pid))


def still_live(delivered: Mapping[Member, str], live: Iterable[Member]) -> dict[Member, str]:
    """``delivered`` without the receivers that are gone: it never grows past the live."""
    alive = set(live)
    return {m: key for m, key in delivered.items() if m in alive}


def still_silent(silent: Mapping[Member, float], live: Mapping[Member, float]
                 ) -> dict[Member, float]:
    """The members a round dropped for silence (each with its heartbeat's time when dropped)
    that are still live and have not pulsed since (pure): one whose heartbeat moved is
    alive again (it was paused, or slow) and is invited again; a dead one stays left out
    until its liveness key lapses."""
    return {m: ts for m, ts in silent.items() if live.get(m) == ts}


async def delete_manifest(bus: Bus, run_keys: RunKeys, ref: BlobRef) -> None:
    """Remove a broadcast publication's manifest (its bytes were never stored). Wraps DEL and
    SREM."""
    await bus.pipeline([("DEL", f"{ref.key}:m"), ("SREM", run_keys.blobs, f"{ref.key}:m")],
                       atomic=True)


# ---------------------------------------------------------------------- the trainer's side

_REDIS_GONE = (BusRefusedWrite, BusAuthError, BusUnavailable)
"""What ends the broadcasts as is, for the trainer to name once: Redis refusing writes for
its own state (out of memory, unable to persist), the ACL a right, or Redis past its retries.
A round cannot start while any holds, and neither can the trainer's other writes."""


class _Unheard(Exception):
    """The trainer's ``warn`` raised ``cause``: not a round's trouble, the trainer's."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Outgoing(msgspec.Struct):
    ref: BlobRef
    version: int
    buf: memoryview


class Broadcaster(WeightsPublisher):
    """The trainer's side (a :class:`~weights.transport.WeightsPublisher`):
    :meth:`publish` the newest weights, :meth:`run` the rounds (a task of the trainer, until
    cancelled). ``host``: the address receivers reach this
    process at; ``timeout_s``: gloo's timeout (a stalled broadcast fails after it);
    ``warn(text)``: told when a round leaves someone without the publication; ``silent_s``:
    how long a member may go without a pulse mid-round before the round is dropped and the
    others served without it."""

    store = STORE

    def __init__(self, bus: Bus, run_keys: RunKeys, *, epoch: str, host: str,
                 timeout_s: float, join_timeout_s: float = JOIN_TIMEOUT_S,
                 chunk_size: int = CHUNK_SIZE,
                 warn: Callable[[str], Awaitable[object]] | None = None,
                 silent_s: float = SILENT_S) -> None:
        self.bus, self.run_keys, self.epoch, self.host = bus, run_keys, epoch, host
        self.timeout_s, self.join_timeout_s = timeout_s, join_timeout_s
        self.chunk_size, self.warn, self.silent_s = chunk_size, warn, silent_s
        self.latest: _Outgoing | None = None
        self.delivered: dict[Member, str] = {}
        self.silent: dict[Member, float] = {}
        """Members a round dropped for silence, left out until they pulse again."""
        self.rounds = 0
        self.wake = asyncio.Event()
        self.worker = Worker()

    async def publish(self, name: str, tensors: Mapping[str, torch.Tensor],
                      version: int) -> BlobRef:
        """Copy ``tensors`` into one buffer and hash its chunks (on a thread), write the
        manifest (wraps SADD, SET), and make it the publication the rounds send."""
        buf, m = await asyncio.to_thread(flatten, tensors, self.chunk_size)
        data = encode_manifest(m)
        key = self.run_keys.blob(name)
        await self.bus.command("SADD", self.run_keys.blobs, f"{key}:m")
        await self.bus.command("SET", f"{key}:m", data)
        ref = BlobRef(store=STORE, key=key, size=m.size,
                      sha256=hashlib.sha256(data).hexdigest(), chunks=len(m.chunks))
        self.latest = _Outgoing(ref, version, buf)
        self.wake.set()
        return ref

    async def run(self) -> None:
        """Serve rounds until cancelled: at each publication, and every :data:`POLL_S`. A
        round in flight then stops (bounded: :meth:`Worker.close`). A round that cannot
        start (no free port for the store, a Redis error of the moment) is told and tried
        again at the next turn: this task never dies silently while rollouters wait on it.
        It ends, raising as is, on what the trainer must act on: what the ``warn`` callback
        raises (the trainer's own write refused: fenced out, or the log behind what it
        wrote, so it must start over) and Redis refusing every write or gone
        (:data:`_REDIS_GONE`), which the trainer's other writes meet too; told as a
        round's trouble, it was said twice."""
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), POLL_S)
                self.wake.clear()
                try:
                    await self._turn()
                except _Unheard as exc:
                    raise exc.cause from None
        finally:
            await self.worker.close()

    async def _turn(self) -> None:
        try:
            await self.serve()
        except (_Unheard, *_REDIS_GONE):
            raise
        except Exception as exc:
            await self._told(f"weights broadcast round failed to start: {first_line(exc)}; "
                             "trying again")

    async def _told(self, text: str) -> None:
        """``text`` given to ``warn`` (which says it), else logged; what ``warn`` raises is
        :class:`_Unheard`."""
        if self.warn is None:
            log.warning("%s", text)
            return
        try:
            await self.warn(text)
        except Exception as exc:
            raise _Unheard(exc) from exc

    async def receivers(self) -> list[Member]:
        """The live rollouters that take part in broadcasts (their heartbeats). Wraps
        SMEMBERS and MGET."""
        return list(await self._beats())

    async def _beats(self) -> dict[Member, float]:
        """:meth:`receivers`, each with its heartbeat's time."""
        beats = await peers(self.bus, self.run_keys.alive_pattern("rollouter"))
        return {Member(hb.rank, hb.pid): hb.ts for hb in beats if hb.weights_receiver}

    async def serve(self) -> list[Member]:
        """One round for the live receivers that lack the newest publication, if any.
        Returns those it served."""
        latest = self.latest
        if latest is None:
            return []
        live = await self._beats()
        self.delivered = still_live(self.delivered, live)
        self.silent = still_silent(self.silent, live)
        invited = invite([m for m in live if m not in self.silent], self.delivered,
                         latest.ref.key)
        if not invited:
            return []
        served = await self._round(latest, invited)
        for member in served:
            self.delivered[member] = latest.ref.key
        return served

    async def _round(self, latest: _Outgoing, invited: list[Member]) -> list[Member]:
        self.rounds += 1
        server = await self.worker.call(open_store, self.timeout_s)
        ref = latest.ref
        plan = RoundPlan(round=f"{self.epoch}/{self.rounds}", key=ref.key, sha256=ref.sha256,
                         size=ref.size, chunks=ref.chunks, version=latest.version,
                         host=self.host, port=server.port, members=invited,
                         join_timeout_s=self.join_timeout_s, timeout_s=self.timeout_s)
        ttl_ms = int((self.join_timeout_s + self.timeout_s) * 1000)
        await self.bus.command("SET", self.run_keys.weights_round,
                               _PLAN_ENCODER.encode(plan), "PX", ttl_ms)
        try:
            outcome = await self.worker.call(send_round, server, plan, latest.buf,
                                             self.silent_s)
        finally:
            del server  # closes the store's port
        if outcome.silent:
            await self._left_out([invited[i - 1] for i in outcome.silent])
        if outcome.trouble is not None:
            self.wake.set()  # the others are served in a new round at once
            await self._told(f"weights v{latest.version} broadcast round {plan.round} to "
                             f"{[m.rank for m in invited]}: {outcome.trouble}; those "
                             "without it are invited again")
        return [invited[i - 1] for i in outcome.served]

    async def _left_out(self, members: list[Member]) -> None:
        """Leave ``members`` (silent in a round) out of the next rounds until their
        heartbeats move: a dead one would otherwise be waited for at every round, for the
        join timeout, until its liveness key lapses."""
        live = await self._beats()
        self.silent.update({m: live[m] for m in members if m in live})

    async def delete(self, ref: BlobRef) -> None:
        await delete_manifest(self.bus, self.run_keys, ref)

    def location(self, ref: BlobRef) -> str:
        return f"broadcast from the trainer at {self.host} (manifest: redis key {ref.key}:m)"


# ---------------------------------------------------------------------- a rollouter's side

class Receiver(WeightsFetcher):
    """A rollouter's side (a :class:`~weights.transport.WeightsFetcher`): :meth:`run`
    takes part in every round it is invited to (a task of the rollouter, until cancelled;
    its heartbeat then says ``weights_receiver``), and :meth:`fetch` / :meth:`take` hand over
    a received publication."""

    store = STORE

    def __init__(self, bus: Bus, run_keys: RunKeys, me: Member, *,
                 poll_s: float = _RECEIVER_POLL_S, wait_s: float = JOIN_TIMEOUT_S * 1.5) -> None:
        self.bus, self.run_keys, self.me, self.poll_s = bus, run_keys, me, poll_s
        self.wait_s = wait_s  # how long fetch waits for a round to bring a publication
        self.held: tuple[str, dict[str, torch.Tensor]] | None = None
        self.receiving: str | None = None  # the key of the round in progress
        self.last_round = ""
        self.rounds = 0
        """Rounds this receiver was invited to, counted when each starts and when it ends:
        the trainer trying to serve it (a fetch's bound counts from the last change, so a
        round that held this receiver long, a paused trainer's, is not counted against
        the trainer that serves it next)."""
        self.outcome = "no round yet"  # the last round's outcome, for errors
        self.host = "?"
        self.changed = asyncio.Condition()
        self.worker = Worker()

    async def run(self) -> None:
        """Poll the round key (wraps GET) and take part in each round that invites us,
        until cancelled (a round in flight then stops, bounded). A failed poll (Redis past
        its retries) is kept as the outcome a waiting fetch names, and polled again."""
        try:
            while True:
                try:
                    plan = await self._plan()
                except Exception as exc:
                    await self._told(f"the round key could not be read: {first_line(exc)}")
                    plan = None
                if (plan is not None and plan.round != self.last_round
                        and self.me in plan.members):
                    self.last_round = plan.round
                    await self._take_part(plan)
                await asyncio.sleep(self.poll_s)
        finally:
            await self.worker.close()

    async def _plan(self) -> RoundPlan | None:
        data = await self.bus.command("GET", self.run_keys.weights_round)
        if data is None:
            return None
        try:
            return _PLAN_DECODER.decode(data)
        except msgspec.DecodeError:
            return None  # not ours to fix: the trainer writes the next one whole

    async def _take_part(self, plan: RoundPlan) -> None:
        self.rounds += 1
        self.host = f"{plan.host}:{plan.port}"
        index = plan.members.index(self.me) + 1
        try:
            data = await self.bus.command("GET", f"{plan.key}:m")
            if data is None:
                raise BlobNotFound(f"weights manifest {plan.key}:m does not exist")
            m = decode_manifest(plan.ref(), data)
        except BlobError as exc:
            await self._told(f"round {plan.round} (v{plan.version}): {exc}")
            return
        self.receiving = plan.key
        try:
            buf = await self._receive(plan, index, m)
        except (BlobError, RoundDropped, RuntimeError, OSError) as exc:  # and torch's
            await self._told(f"round {plan.round} (v{plan.version}) failed: {first_line(exc)}")
            return
        finally:
            self.receiving = None
            self.rounds += 1
        if buf is None:
            await self._told(f"round {plan.round} (v{plan.version}) went on without us "
                             "(joined late)")
            return
        self.held = (plan.key, _tensors(m, buf))
        await self._told(f"round {plan.round}: v{plan.version} received")

    async def _receive(self, plan: RoundPlan, index: int, m: Manifest) -> memoryview | None:
        """:func:`receive_round` on the worker. Torch's store client has no bound on a call
        its server never answers: a trainer paused while it runs a round (a zombie, a
        stopped VM) keeps the connection open and answers nothing, and the call would hang
        until it wakes or dies. So the round's thread must hear from the store (its
        :class:`~weights.collective_round.RoundClock`) within :data:`CONNECT_S` plus the join
        timeout (the longest a live trainer's round goes without a word: the group's
        forming) and a margin; else the round is given up, its thread left behind (it ends
        when that trainer does), and the next rounds run on a fresh worker."""
        clock = RoundClock()
        call = asyncio.ensure_future(self.worker.call(receive_round, plan, index, m, clock))
        bound = CONNECT_S + plan.join_timeout_s + _ANSWER_MARGIN_S
        while not call.done():
            await asyncio.wait({call}, timeout=_RECEIVER_POLL_S * 10)
            if call.done() or clock.still_s() < bound:
                continue
            self.worker.stop.set()  # it gives up at its first wait, if it ever gets one
            self.worker = Worker()
            call.add_done_callback(lambda c: c.cancelled() or c.exception())
            raise BlobError(f"the trainer's round store at {plan.host}:{plan.port} did not "
                            f"answer for {bound:g} s (the trainer paused?)")
        return call.result()

    async def _told(self, outcome: str) -> None:
        async with self.changed:
            self.outcome = outcome
            self.changed.notify_all()

    async def take(self, ref: BlobRef, wait_s: float = JOIN_TIMEOUT_S * 1.5
                   ) -> dict[str, torch.Tensor]:
        """The tensors of publication ``ref`` once received (handed over once). Waits while
        a round sends it; none within ``wait_s`` otherwise is :class:`TransportUnreachable`
        naming the last round's outcome."""
        deadline = time.monotonic() + wait_s
        async with self.changed:
            while True:
                if self.held is not None and self.held[0] == ref.key:
                    tensors, self.held = self.held[1], None
                    return tensors
                left = deadline - time.monotonic()
                if left <= 0 and self.receiving != ref.key:
                    raise TransportUnreachable(
                        f"no broadcast of {ref.key} reached this rollouter within "
                        f"{wait_s:g} s (last round: {self.outcome})")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), max(left, 1.0))

    async def fetch(self, ref: BlobRef) -> dict[str, torch.Tensor]:
        """:meth:`take` within ``wait_s`` (the :class:`~weights.transport.WeightsFetcher`
        a rollouter holds)."""
        return await self.take(ref, self.wait_s)

    def coming(self, key: str) -> bool:
        """Whether publication ``key`` is being received or is held (not yet taken)."""
        return self.receiving == key or (self.held is not None and self.held[0] == key)

    def location(self, ref: BlobRef) -> str:
        return f"the trainer's broadcast ({self.host}; manifest: redis key {ref.key}:m)"
