"""The rollouter's weights: the publications read from the log, the one loaded, the newest
being fetched and decoded beside generation (a double buffer), and those that failed
(:class:`HeldWeights`); where a publication is fetched from (:class:`WeightsFetcher`); and
the waits for the weights a replica needs: the first publication, the version its tickets
or a validation ask for (:class:`WeightsHolder`).

The newest publication in log order that is not known to be unloadable is current: after a
resume from a log that lost its tail, a lower version can be the current one. A publication
whose blob is gone is passed over: silently when :data:`BLOBS_KEPT` newer publications
follow it in the log (the trainer deleted it while this replica was busy), else with a
``weights_unloadable`` warning (a publication no trainer made, or a blob lost). One that
cannot be loaded (corrupt, not a state dict, another model's) is passed over with that
warning too. Either way the newest loadable one before it is loaded instead. A fetch that
is no longer wanted is cancelled and its outcome retrieved: nothing is left to fail unseen.

A publication whose storage cannot be read from here at all (a node without the run's
storage) is different: :func:`fetch_within` says so at once (a ``weights_unreachable``
warning naming the version and the location), tries again with backoff, and after
``rollout.weights_fetch_timeout_s`` fails the rollouter (:class:`WeightsUnreachable`, exit 1).
A rollouter that has no weights and none of the published ones loadable for as long fails
too (:class:`WeightsLost`), never waiting in silence for a stall timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

from bus import BlobError, BlobNotFound, Bus, Delivery, RunKeys
from policy.weights import from_bytes
from rollouter.events import EventPoller
from rollouter.presence import Presence
from rollouter.tickets import Ticket, TicketDesk
from runschema.messages import WarningRaised, WeightsPublished
from runtime import Failure
from weights.blobs import open_store
from weights.collective import Receiver
from weights.collective_round import STORE as COLLECTIVE
from weights.collective_round import Member
from weights.transport import TransportUnreachable, is_manifest_ref, open_transport

__all__ = ["HeldWeights", "State", "WeightsFetcher", "WeightsHolder", "WeightsLost",
           "WeightsUnreachable", "fetch_published", "fetch_within"]

State = dict[str, torch.Tensor]
Warn = Callable[[WarningRaised], Awaitable[object]]

RESTAGE_S = 2.0
"""While it waits for a fetch that may never complete (a broadcast publication that no round
is bringing: the trainer sends only its newest), a rollouter reads the log this often, and a
newer publication replaces the fetch."""

BLOBS_KEPT = 3
"""The trainer deletes a publication's blob only once this many newer ones follow it in the
log (docs/architecture.md, "Weights"): a blob missing before that is worth a warning."""


class WeightsUnreachable(Failure):
    """A publication's storage stayed unreadable from here for the fetch timeout."""


class WeightsLost(Failure):
    """No weights held, and none of the published ones could be loaded for the timeout."""


async def fetch_within(fetch: Callable[[], Awaitable[State]], msg: WeightsPublished,
                       location: str, timeout_s: float, source: str,
                       warn: Warn, tries: Callable[[], int] | None = None) -> State:
    """``fetch()``, tried again with backoff (0.5 s doubling to 5 s) while the storage is
    unreachable (:class:`TransportUnreachable`): the first failure is told at once
    (``weights_unreachable``), and one lasting ``timeout_s`` is :class:`WeightsUnreachable`.
    ``tries``: how many times the sender has tried to bring it so far (the trainer's
    broadcast rounds this rollouter was invited to); the bound counts from the last try, so
    a rollouter whose rounds fail for another member's fault (one killed mid-round holds
    the round for gloo's timeout) never gives up while the trainer keeps trying. Other
    errors (missing, corrupt) are the caller's."""
    start, delay, told = time.monotonic(), 0.5, False
    tried = None if tries is None else tries()
    while True:
        try:
            return await fetch()
        except TransportUnreachable as exc:
            if tries is not None and tries() != tried:
                tried, start = tries(), time.monotonic()
            waited = time.monotonic() - start
            if not told:
                told = True
                await warn(WarningRaised(
                    source=source, code="weights_unreachable",
                    message=f"weights v{msg.version} unreachable at {location}: {exc}; "
                            f"trying again for up to {timeout_s:g} s "
                            "(rollout.weights_fetch_timeout_s)"))
            if waited >= timeout_s:
                raise WeightsUnreachable(
                    f"WeightsUnreachable: weights v{msg.version} at {location} stayed "
                    f"unreadable for {waited:.0f} s (rollout.weights_fetch_timeout_s="
                    f"{timeout_s:g}): {exc}") from None
            await asyncio.sleep(min(delay, max(timeout_s - waited, 0.0)))
            delay = min(delay * 2, 5.0)


async def fetch_published(msg: WeightsPublished, *, bus: Bus, keys: RunKeys,
                          root: str | Path, timeout_s: float, source: str,
                          warn: Warn, receiver: Callable[[], Receiver]) -> State:
    """The tensors of publication ``msg``. One published tensor by tensor (a transport's
    manifest): chunks fetched in parallel, each checked, an unreachable storage told at once
    and a failure after ``timeout_s`` (:func:`fetch_within`). One broadcast by the trainer:
    taken from this process's ``receiver()`` (started at the first such publication), with
    the same warning and failure when none arrives. A whole blob (an older log's): read,
    then decoded on a thread of its own (the generation worker is busy meanwhile).
    ``root``: the storage transport's root, ``run.storage/RUN/blobs``."""
    ref = msg.manifest or msg.ref
    if ref.store == COLLECTIVE:
        taker = receiver()
        return await fetch_within(lambda: taker.take(ref), msg, taker.location(ref),
                                  timeout_s, source, warn, tries=lambda: taker.rounds)
    if is_manifest_ref(ref):
        transport = open_transport(ref.store, bus=bus, run_keys=keys, root=root)
        return await fetch_within(lambda: transport.fetch(ref), msg, transport.location(ref),
                                  timeout_s, source, warn)
    store = open_store(msg.ref.store, bus=bus, run_keys=keys, root=root)
    blob = await store.get(msg.ref)
    return await asyncio.to_thread(from_bytes, blob)


class WeightsFetcher:
    """How replica ``member`` fetches a publication (:func:`fetch_published`): from the
    run's transports under ``root``, or from its receiver of the trainer's broadcasts, started
    at the first broadcast publication it reads (whatever its own
    rollout.weights_transport says: the trainer's decides) as a task of ``spawn``;
    ``started`` is told then (the replica's next pulse says so to the trainer)."""

    def __init__(self, bus: Bus, keys: RunKeys, member: Member, *, root: str | Path,
                 timeout_s: float, source: str, warn: Warn,
                 spawn: Callable[[Coroutine[Any, Any, None], str], object],
                 started: Callable[[], None]) -> None:
        self.bus, self.keys, self.member, self.root = bus, keys, member, root
        self.timeout_s, self.source, self.warn = timeout_s, source, warn
        self.spawn, self.started = spawn, started
        self.receiver: Receiver | None = None
        """This replica's part in the trainer's broadcasts, once started."""

    async def fetch(self, msg: WeightsPublished) -> State:
        """The tensors of publication ``msg`` (:func:`fetch_published`)."""
        return await fetch_published(
            msg, bus=self.bus, keys=self.keys, root=self.root, timeout_s=self.timeout_s,
            source=self.source, warn=self.warn, receiver=self._receiving)

    def stranded(self, msg: WeightsPublished) -> bool:
        """A broadcast publication that the receiver is neither receiving nor holding: no
        round will bring it once a newer one is published."""
        ref = msg.manifest or msg.ref
        return ref.store == COLLECTIVE and (self.receiver is None
                                            or not self.receiver.coming(ref.key))

    def _receiving(self) -> Receiver:
        if self.receiver is None:
            self.receiver = Receiver(self.bus, self.keys, self.member)
            self.spawn(self.receiver.run(), "weights-receiver")
            self.started()
        return self.receiver


class HeldWeights:
    """``fetch``: a publication's decoded state dict (off the loop); ``load``: copy one into
    the engine as a version (on the worker); ``warn``: publish a warning; ``reread``: read
    the log again (a newer publication is there when a blob was superseded)."""

    def __init__(self, source: str, *, fetch: Callable[[WeightsPublished], Awaitable[State]],
                 load: Callable[[State, int], Awaitable[object]], warn: Warn,
                 reread: Callable[[], Awaitable[object]],
                 stranded: Callable[[WeightsPublished], bool] = lambda msg: False) -> None:
        self.source = source
        self.fetch, self.load, self.warn, self.reread = fetch, load, warn, reread
        # Whether a fetch in flight may never complete (nothing is bringing it), so that a
        # newer publication should replace it. Other fetches complete, and are loaded: giving
        # them up for each newer publication could load nothing when fetches are slower than
        # publications.
        self.stranded = stranded
        self.version = -1
        self.loaded: WeightsPublished | None = None
        # Recent publications in log order; the newest loadable one is current.
        self.published: deque[WeightsPublished] = deque(maxlen=8)
        self.bad: set[str] = set()  # blob keys that failed to load
        self.why: dict[str, str] = {}  # ... and why (for WeightsLost)
        self.seen = 0  # publications read from the log
        # The newest publication being fetched and decoded (double buffer), if any.
        self.staging: tuple[WeightsPublished, asyncio.Future[State]] | None = None
        # Superseded fetches that found no blob: told at the next swap (stage is not async).
        self.missing: list[tuple[WeightsPublished, BlobNotFound]] = []
        # The last load: seconds copying into the engine, and from publication to loaded.
        self.load_s: float | None = None
        self.sync_s: float | None = None

    def saw(self, msg: WeightsPublished) -> None:
        """A publication read from the log (in log order)."""
        self.seen += 1
        if msg.ref.key not in self.bad:
            self.published.append(msg)

    @property
    def newest(self) -> WeightsPublished | None:
        """The newest publication (in log order) not known to be unloadable."""
        for msg in reversed(self.published):
            if msg.ref.key not in self.bad:
                return msg
        return None

    def stage(self) -> None:
        """Start fetching and decoding the newest publication in the background: generation
        with the loaded weights goes on meanwhile, and the swap only copies the tensors in."""
        newest = self.newest
        if newest is None or newest is self.loaded:
            return
        if self.staging is not None:
            if self.staging[0] is newest:
                return
            self._drop(*self.staging)
        self.staging = (newest, asyncio.ensure_future(self.fetch(newest)))

    def ready(self) -> bool:
        """Newer weights than those loaded are fetched and decoded (or their fetch ended in
        an error): a ``swap(wait=False)`` acts now. Starts staging the newest first."""
        self.stage()
        return self.staging is not None and self.staging[1].done()

    async def swap(self, wait: bool = True) -> None:
        """Load the newest published weights if they are not ours; ``wait=False``: only if
        they are already fetched and decoded (else they keep staging, and the caller goes on
        with the weights it has, which its tickets allow)."""
        self.stage()
        await self._tell_missing()
        if self.staging is None:
            return
        newest, task = self.staging
        if not wait and not task.done():
            return
        if await self._superseded(newest, task):
            await self.swap(wait)  # stages the newer one, dropping this fetch
            return
        self.staging = None
        try:
            state = await task
        except Failure:
            raise  # the storage stayed unreachable: the rollouter's named end
        except BlobNotFound as exc:
            self.bad.add(newest.ref.key)
            self.why[newest.ref.key] = f"v{newest.version}: {exc}"
            await self.reread()
            if not self._deleted(newest):
                await self._unloadable(newest, exc)
            await self.swap(wait)
            return
        except Exception as exc:
            # Corrupt, a WeightsPublished that no trainer wrote, or not a state dict: fall
            # back to the newest loadable publication before it.
            await self._unloadable(newest, exc)
            await self.swap(wait)
            return
        began = time.monotonic()
        try:
            await self.load(state, newest.version)
        except Failure:
            raise  # the engine is broken by the attempt (EngineBroken): no fallback
        except Exception as exc:  # a state dict of some other model
            await self._unloadable(newest, exc)
            await self.swap(wait)
            return
        self.load_s = time.monotonic() - began
        # Publication to engine, by the two machines' clocks (the publisher's ts).
        self.sync_s = max(0.0, time.time() - newest.ts)
        self.loaded = newest
        self.version = newest.version

    async def _tell_missing(self) -> None:
        """Warn of the superseded fetches that found no blob, unless the trainer may have
        deleted it."""
        missing, self.missing = self.missing, []
        for msg, exc in missing:
            if not self._deleted(msg):
                await self._unloadable(msg, exc)

    async def _superseded(self, msg: WeightsPublished, task: asyncio.Future[State]) -> bool:
        """Wait for the fetch of ``msg``; while it is :attr:`stranded`, read the log every
        :data:`RESTAGE_S`: True when a newer publication appeared first."""
        while not task.done():
            await asyncio.wait({task}, timeout=RESTAGE_S)
            if task.done() or not self.stranded(msg):
                continue
            await self.reread()
            if self.newest is not msg:
                return True
        return False

    def _deleted(self, msg: WeightsPublished) -> bool:
        """The trainer may have deleted ``msg``'s blob: :data:`BLOBS_KEPT` newer
        publications follow it in the log (or pushed it out of those held here)."""
        for i, m in enumerate(self.published):
            if m is msg:
                return len(self.published) - 1 - i >= BLOBS_KEPT
        return True

    def _drop(self, msg: WeightsPublished, task: asyncio.Future[State]) -> None:
        """A fetch no longer wanted (a newer publication is staged): a blob it found missing
        is told at the next swap; one still running is cancelled, its outcome retrieved."""
        if task.done() and not task.cancelled():
            exc = task.exception()
            if isinstance(exc, BlobNotFound):
                self.bad.add(msg.ref.key)
                self.missing.append((msg, exc))
            return
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _unloadable(self, msg: WeightsPublished, exc: Exception) -> None:
        self.bad.add(msg.ref.key)
        why = str(exc) if isinstance(exc, BlobError) else f"{type(exc).__name__}: {exc}"
        self.why[msg.ref.key] = f"v{msg.version}: {why}"
        await self.warn(WarningRaised(
            source=self.source, code="weights_unloadable",
            message=f"weights v{msg.version} ({msg.ref.key}) ignored: {why}",
        ))

    def lost(self) -> str:
        """The publications that failed to load, newest last, and why."""
        return "; ".join(self.why.values()) or "no publication"

    async def cancel(self) -> None:
        """Stop the fetch in flight, if any."""
        staging, self.staging = self.staging, None
        if staging is not None:
            staging[1].cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await staging[1]



class WeightsHolder:
    """The weights this replica holds (``held``) and the waits for those it needs: the
    first publication, the version its tickets ask for, the version a validation asks for.
    Each wait reads the log (``events``: the publications, the run's end) and checks the
    trainer (``trainer``), so none outlives the run or the trainer; a ticket asking for
    weights no publication provides goes back to ``tickets``, dead-lettered.
    ``timeout_s``: rollout.weights_fetch_timeout_s."""

    def __init__(self, held: HeldWeights, *, events: EventPoller, trainer: Presence,
                 tickets: TicketDesk, timeout_s: float) -> None:
        self.held, self.events, self.trainer, self.tickets = held, events, trainer, tickets
        self.timeout_s = timeout_s

    @property
    def version(self) -> int:
        """The weights version this replica holds (-1: none yet)."""
        return self.held.version

    def ready(self) -> bool:
        """Newer weights are fetched and ready to load (:meth:`HeldWeights.ready`)."""
        return self.held.ready()

    async def swap(self, wait: bool = True) -> None:
        """Load the newest published weights (:meth:`HeldWeights.swap`). Profiling steps
        follow the trainer's StepFinished events, not weight versions (rollouter.stepwatch):
        with trigger_parameter_sync_step > 1 a version spans several steps."""
        await self.held.swap(wait)

    async def first(self) -> None:
        """Wait for the trainer's first publication and load it (or the newest loadable
        one); none loadable for :attr:`timeout_s` since the last publication read is
        :class:`WeightsLost` (never a silent wait for the trainer's stall timeout)."""
        held = self.held
        lost_since: float | None = None
        seen = held.seen
        while held.version < 0 and not self.events.finished:
            if held.newest is not None:
                await self.swap()
                if held.version >= 0:
                    return
            if seen != held.seen:  # a new publication: it may load, wait anew
                lost_since, seen = None, held.seen
            if held.bad:
                lost_since = time.monotonic() if lost_since is None else lost_since
                if time.monotonic() - lost_since >= self.timeout_s:
                    raise WeightsLost(
                        f"WeightsLost: none of the published weights could be loaded for "
                        f"{self.timeout_s:g} s (rollout.weights_fetch_timeout_s): "
                        f"{held.lost()}")
            await self.events.poll(block_ms=500)
            await self.trainer.check()

    async def for_tickets(self, deliveries: list[Delivery], tickets: list[Ticket]
                          ) -> list[Ticket]:
        """Wait until this replica holds weights as new as its tickets ask for (on-policy or
        bounded staleness): the newest it knows of first (maybe staging), then what the log
        has since. Returns the tickets it can serve (a ticket asking for weights no
        publication in the log provides is dead-lettered)."""
        while not self.events.finished and tickets:
            need = max(t.min_version for _, t in tickets)
            if self.version >= need:
                break
            await self.swap()
            if self.version >= need:
                break
            caught_up = await self.events.poll(block_ms=500)
            await self.swap()
            await self.trainer.check()
            newest = self.held.newest
            if caught_up and newest is not None and need > newest.version:
                # The trainer publishes weights before the tickets that need them, so once
                # we have read the whole log, a ticket asking for more than its newest
                # weights was issued in a stretch of log that Redis lost (or was forged).
                tickets = await self.tickets.drop_unservable(deliveries, tickets,
                                                             newest.version)
        return tickets

    async def at_least(self, version: int) -> bool:
        """Wait until this replica holds weights ``version`` or newer (or the run ends);
        False once the whole log is read and holds no such publication (a stretch of log
        Redis lost)."""
        await self.swap()
        while self.version < version and not self.events.finished:
            caught_up = await self.events.poll(block_ms=500)
            await self.swap()
            await self.trainer.check()
            newest = self.held.newest
            if caught_up and self.version < version and (
                    newest is None or newest.version < version):
                return False
        return True
