"""A rollouter replica's side of the prompts stream: the tickets it reads, retries and
answers.

A pipeline around the generation worker: the next tickets are read (:meth:`TicketDesk.prefetch`)
and the last batch's samples published with the acks of their tickets
(:meth:`TicketDesk.deliver`) while a batch generates; at most one of each in flight. A failed
ticket is retried, then dead-lettered after :data:`MAX_ATTEMPTS`; tickets pending on replicas
whose liveness key lapsed come back to the live ones.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from bus import Bus, Delivery, Refusal, RunKeys, peers
from runschema.messages import (
    Event,
    Message,
    PromptTicket,
    RolloutFailed,
    Sample,
    TicketsClaimed,
    ValidationRequested,
)

__all__ = ["GROUP", "MAX_ATTEMPTS", "MAX_N", "Ticket", "TicketDesk", "TicketSource",
           "dead_replicas"]

GROUP = "rollouter"
MAX_ATTEMPTS = 3  # tries of one ticket before it goes to the dead-letter stream
MAX_N = 4096  # responses one ticket may ask for; more is not a ticket we wrote

Ticket = tuple[str, PromptTicket]  # (entry id, ticket)


async def _ready(done: list[Ticket], samples: dict[str, list[Sample]]
                 ) -> tuple[list[Ticket], dict[str, list[Sample]]]:
    """Answers already made, as :meth:`TicketDesk.deliver_later` takes them."""
    return done, samples


class TicketSource(Protocol):
    """Where a replica's tickets come from and where its answers go with their acks: its
    member of the rollouters' group (:class:`bus.Consumer`), or a scripted one in tests."""

    @property
    def name(self) -> str:
        """The member's name in the group (``RunKeys.rollouter_consumer(rank)``)."""
        ...

    async def read(self, count: int = 64, block_ms: int | None = 1000) -> list[Delivery]: ...

    async def ack(self, *ids: str | Delivery) -> int: ...

    async def publish_and_ack(self, stream: str, msgs: Sequence[Message],
                              *ids: str | Delivery) -> list[str]: ...

    async def dead_letter(self, entry: str | Delivery, reason: str, raw: bytes = b"") -> None: ...

    async def dead_letter_many(self, refusals: Sequence[Refusal]) -> int: ...

    async def reclaim_from(self, owners: Iterable[str], count: int = 100) -> list[Delivery]: ...


async def dead_replicas(bus: Bus, keys: RunKeys, own: str, settle_s: float = 0.0
                        ) -> list[str]:
    """The members of the rollouters' group other than ``own`` whose liveness key has lapsed
    (by Redis's clock): a slow replica generating for minutes is alive; a dead one is not.
    None within ``settle_s`` of an outage of Redis (the heartbeat timeout): every key may
    have lapsed while nobody could refresh it, and live replicas re-pulse meanwhile."""
    members = await bus.consumers(keys.prompts, GROUP)
    if not members:
        return []
    alive = {RunKeys.rollouter_consumer(hb.rank)
             for hb in await peers(bus, keys.alive_pattern("rollouter"))}
    if bus.since_dark_s() < settle_s:
        return []
    return [m for m in members if m not in alive and m != own]


class TicketDesk:
    """Replica ``rank``'s tickets, read from ``source`` (its member of the rollouters'
    group) ``batch`` at a time; its samples go to ``samples`` (the run's samples stream).
    ``poll``: read the events after the tickets (the StepFinished that begins their step
    precedes them in the log); ``publish``: the replica's events; ``validates``: validation
    requests are served (data.val_files), else dead-lettered; ``find_dead``: the group's
    members whose replicas are dead (:func:`dead_replicas`)."""

    def __init__(self, source: TicketSource, samples: str, *, rank: int, batch: int,
                 poll: Callable[[], Awaitable[object]],
                 publish: Callable[[Event], Awaitable[None]], validates: bool,
                 find_dead: Callable[[], Awaitable[list[str]]]) -> None:
        self.source, self.samples = source, samples
        self.rank, self.batch, self.validates = rank, batch, validates
        self._poll, self._publish, self._find_dead = poll, publish, find_dead
        self.attempts: dict[str, int] = {}
        self.retry: list[Delivery] = []
        self.prefetching: asyncio.Task[list[Delivery]] | None = None
        self.delivering: asyncio.Future[list[str]] | None = None
        self.published = 0  # samples handed to the bus: part of the heartbeat's progress
        self.val_requests: list[Delivery] = []  # served between batches, in order

    @property
    def validations_waiting(self) -> bool:
        """Validation requests were read and wait to be served."""
        return bool(self.val_requests)

    def next_validation(self) -> Delivery | None:
        """The oldest validation request waiting (taken off the list), if any."""
        return self.val_requests.pop(0) if self.val_requests else None

    async def accept(self, deliveries: list[Delivery]) -> list[Ticket]:
        """The tickets among ``deliveries``; validation requests are kept for after the
        batch; anything else is dead-lettered with a reason, all in one round trip."""
        tickets = []
        refused: list[Refusal] = []
        for d in deliveries:
            if isinstance(d.msg, PromptTicket) and 1 <= d.msg.n <= MAX_N:
                tickets.append((d.id, d.msg))
            elif isinstance(d.msg, PromptTicket):
                refused.append(Refusal(d, f"ticket asks for n={d.msg.n} responses (1..{MAX_N})",
                                       "ticket out of range"))
            elif isinstance(d.msg, ValidationRequested) and self.validates:
                self.val_requests.append(d)
            else:
                refused.append(Refusal(d, f"expected a PromptTicket, got {type(d.msg).__name__}",
                                       "not a ticket"))
        if refused:
            await self.source.dead_letter_many(refused)
        return tickets

    async def retry_or_give_up(self, deliveries: list[Delivery], failed: dict[str, str]
                               ) -> None:
        """A failed ticket is an event; it is retried here, then dead-lettered after
        MAX_ATTEMPTS (counting the deliveries before ours); the trainer then frees its
        budget slot."""
        for ticket_id, error in failed.items():
            await self._publish(RolloutFailed(ticket_id=ticket_id, rank=self.rank, error=error))
        for d in deliveries:
            tid = getattr(d.msg, "ticket_id", None)
            if tid not in failed:
                continue
            self.attempts[tid] = self.attempts.get(tid, d.deliveries - 1) + 1
            if self.attempts[tid] >= MAX_ATTEMPTS:
                del self.attempts[tid]
                await self.source.dead_letter(
                    d, f"rollout failed {MAX_ATTEMPTS} times; last: {failed[tid]}")
            else:
                self.retry.append(d)

    async def deliver(self, done: list[Ticket], samples: dict[str, list[Sample]]) -> None:
        """All responses of these tickets land together with the acks of their tickets, in
        the background: the next batch generates meanwhile."""
        if done:
            await self.deliver_later(_ready(done, samples))

    async def deliver_later(
        self, answers: Awaitable[tuple[list[Ticket], dict[str, list[Sample]]]]
    ) -> None:
        """As :meth:`deliver`, for answers still being made (scored): ``answers`` runs in
        the background after the batch before is out, then its samples are published with
        their tickets' acks. Its failure is raised by the next delivery, the next look for
        tickets (:meth:`next`) or :meth:`delivered`."""
        await self.delivered()
        self.delivering = asyncio.ensure_future(self._deliver(answers))

    async def _deliver(self, answers: Awaitable[tuple[list[Ticket], dict[str, list[Sample]]]]
                       ) -> list[str]:
        done, samples = await answers
        if not done:
            return []
        batch = [sample for _, t in done for sample in samples[t.ticket_id]]
        self.published += len(batch)
        return await self.source.publish_and_ack(self.samples, batch,
                                                 *(entry_id for entry_id, _ in done))

    async def delivered(self) -> None:
        """Wait for the batch being published (if any); its failure is raised here."""
        task, self.delivering = self.delivering, None
        if task is not None:
            await task

    def prefetch(self) -> None:
        """Start reading the next tickets while this batch generates (retries go first)."""
        if self.prefetching is None and not self.retry:
            self.prefetching = asyncio.create_task(self._read_ahead())

    async def _read_ahead(self) -> list[Delivery]:
        """The next tickets (a blocking XREADGROUP, at most 200 ms; claimed), then the
        events after them."""
        deliveries = await self.source.read(count=self.batch, block_ms=200)
        if deliveries:
            await self.claim(deliveries)
            await self._poll()
        return deliveries

    async def claim(self, deliveries: Sequence[Delivery]) -> None:
        """State in the log that the tickets among ``deliveries`` are this replica's now,
        before generating for them: the trainer trains an answer only from a replica that
        claimed its ticket (trainer.claims), and this claim precedes the answer in the log.
        Every way a ticket reaches a replica (a read, its own pending entries read again, a
        reclaim) comes through here; a retry is the same claim."""
        tickets = [d.msg for d in deliveries if isinstance(d.msg, PromptTicket)]
        if tickets:
            await self._publish(TicketsClaimed(ticket_ids=[t.ticket_id for t in tickets],
                                               attempts=[t.attempt for t in tickets],
                                               rank=self.rank))

    async def ready_within(self, other: asyncio.Event, timeout_s: float) -> bool:
        """Read ahead and wait, at most ``timeout_s``, until its tickets are here or
        ``other`` is set; whether tickets are ready (the read goes on otherwise)."""
        self.prefetch()
        waiter = asyncio.ensure_future(other.wait())
        waits: set[asyncio.Future[Any]] = {waiter}
        if self.prefetching is not None:
            waits.add(self.prefetching)
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return self.has_ready()

    def has_ready(self) -> bool:
        """Tickets are here to serve now: retries, or a read ahead that has returned."""
        return bool(self.retry) or (self.prefetching is not None and self.prefetching.done())

    async def next(self) -> tuple[list[Delivery], bool]:
        """Tickets to serve next (retries first, then the read ahead, else a read now, each
        followed by the events after it) and whether the events were read after them. A
        publication that failed meanwhile is raised here, not only at the next delivery:
        with no ticket left to answer there may be none (Redis refused the last batch's
        samples, and the trainer, refused too, issues no more)."""
        if self.delivering is not None and self.delivering.done():
            await self.delivered()
        if self.retry:
            deliveries, self.retry = self.retry, []
            return deliveries, False
        task, self.prefetching = self.prefetching, None
        return await (task if task is not None else self._read_ahead()), True

    async def reclaim_from_dead_replicas(self) -> list[Delivery]:
        """Tickets pending on replicas whose liveness key has lapsed (by Redis's clock): a
        slow replica generating for minutes keeps its tickets; a dead one's come back."""
        dead = await self._find_dead()
        reclaimed = await self.source.reclaim_from(dead) if dead else []
        await self.claim(reclaimed)
        return reclaimed

    async def drop_unservable(self, deliveries: list[Delivery], tickets: list[Ticket],
                              newest: int) -> list[Ticket]:
        """Dead-letter the tickets asking for weights newer than ``newest``, the newest in
        the whole log (issued in a stretch of log Redis lost, or forged); the rest."""
        asking = {i: t.min_version for i, t in tickets if t.min_version > newest}
        for d in deliveries:
            if d.id in asking:
                await self.source.dead_letter(
                    d, f"ticket asks for weights v{asking[d.id]} but the newest in the "
                       f"log is v{newest}: issued in a stretch of log Redis lost")
        return [(i, t) for i, t in tickets if i not in asking]

    async def stop(self) -> None:
        """Cancel the read ahead and the publication in flight."""
        pipeline = (self.prefetching, self.delivering)
        self.prefetching = self.delivering = None
        for task in (t for t in pipeline if t is not None):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
