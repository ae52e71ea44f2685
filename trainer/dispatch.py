"""Ticket dispatch: prompt tickets issued within the staleness budget, their leases, reissues.

The trainer is the only issuer, so the budget (trainer.budget) is exact with any number of
rollouters. Tickets are written with the TicketsIssued event that records them, in one fenced
script (trainer.writer), and the ledger (trainer.ledger) is folded from those events.

Every open ticket has a lease: unanswered for ``heartbeat.ticket_lease_s`` (auto: at least
the heartbeat timeout, 4x the slowest answer seen) it is reissued as a new attempt with the
current weights, but only when it is lost: gone from the prompts stream (a lost log tail, a
trim), pending on a rollouter whose liveness key lapsed, or pending on a live rollouter that
made no progress for :meth:`Dispatch.progress_bound` (its heartbeat's progress counter, which
counts decode steps, reward calls and published samples, stayed put: a wedged generation
whose pulse goes on; :func:`no_progress`, with a ``WarningRaised(rollouter_no_progress)``).
A ticket still queued, held by a live rollouter that progresses however slowly, or already
answered keeps its lease: a slow peer is not a dead one. The first complete answer of any
attempt wins; later copies are acked and dropped.

A ticket is answered again at most once per attempt for answers that failed: an invalid
answer (trainer.intake) and the dead letter it becomes (:meth:`Dispatch.reissue_lost`) both
replace only the attempt they belong to, so one bad group gives one new attempt.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Container, Mapping, Sequence

from bus import Bus, RunKeys
from bus.messages import (
    Message,
    PromptTicket,
    Sample,
    TicketsClosed,
    TicketsIssued,
    WarningRaised,
)
from runconfig import Config
from tasks import PromptSource
from trainer.budget import ticket_budget
from trainer.ledger import OpenTicket, ticket_id, ticket_index
from trainer.watch import Peers
from trainer.writer import Writer

__all__ = ["ROLLOUTER_GROUP", "Dispatch", "no_progress"]

ROLLOUTER_GROUP = "rollouter"
"""The prompts stream's consumer group (every rollouter replica is a member)."""


def no_progress(held: Mapping[str, Collection[int]], since: Mapping[str, float], now: float,
                bound: float) -> dict[str, list[int]]:
    """The rollouters (consumer names) that hold tickets and whose progress counter has not
    changed for longer than ``bound`` seconds at ``now``, with the tickets they hold.
    ``held``: the tickets pending on each live rollouter; ``since``: when each one's counter
    last changed (trainer.watch.observe_progress). A rollouter whose progress is unknown (it
    reports none) is never judged: liveness alone keeps its tickets, as before."""
    return {consumer: sorted(tickets) for consumer, tickets in held.items()
            if tickets and consumer in since and now - since[consumer] > bound}


class Dispatch:
    """Issues, leases and reissues the run's prompt tickets through ``writer``."""

    def __init__(self, cfg: Config, bus: Bus, keys: RunKeys, writer: Writer,
                 prompts: PromptSource) -> None:
        self.cfg = cfg
        self.bus = bus
        self.keys = keys
        self.writer = writer
        self.prompts = prompts
        ac = cfg.async_training
        self.capacity = ticket_budget(ac.staleness_threshold, ac.trigger_parameter_sync_step,
                                      ac.require_batches, cfg.trainer.ppo_mini_batch_size)
        self.issued_at: dict[int, float] = {}  # ticket -> monotonic time of its latest attempt
        self.ticket_entry: dict[int, str] = {}  # ticket -> prompts entry of its latest attempt
        self.answer_s: deque[float] = deque(maxlen=64)  # issue -> complete group, recent
        self.reissued = 0

    def lease_s(self) -> float:
        """How long an open ticket may stay unanswered before it is judged."""
        hb = self.cfg.heartbeat
        if hb.ticket_lease_s is not None:
            return hb.ticket_lease_s
        return max(hb.timeout_s, 4 * max(self.answer_s, default=0.0))

    def progress_bound(self) -> float:
        """How long a live rollouter holding tickets may make no progress before they are
        taken from it: the longest of the ticket lease, the heartbeat timeout (a process
        whose work stands still that long is treated as one that fell silent) and one
        reward call's timeout (scoring moves the counter once per call)."""
        return max(self.lease_s(), self.cfg.heartbeat.timeout_s,
                   self.cfg.rollout.reward_timeout_s)

    def answered(self, index: int, at: float) -> None:
        """Ticket ``index`` got a complete answer at ``at`` (monotonic): its answer time
        counts towards the automatic lease."""
        self.answer_s.append(at - self.issued_at.get(index, at))

    def trained(self, indices: Sequence[int]) -> None:
        """These tickets were trained: no lease to watch any more."""
        for index in indices:
            self.issued_at.pop(index, None)
            self.ticket_entry.pop(index, None)

    def restart_leases(self) -> None:
        """On resume: open tickets are still out (pending, unread, or lost with a Redis
        tail); their leases start now."""
        self.issued_at = dict.fromkeys(self.writer.state.ledger.open, time.monotonic())

    def _ticket(self, index: int, n: int, version: int, attempt: int = 0) -> PromptTicket:
        """Ticket ``index`` (its prompt from the task), for weights ``version``."""
        prompt = self.prompts.get(index)
        return PromptTicket(
            ticket_id=ticket_id(index), prompt_id=prompt.prompt_id, prompt=prompt.prompt,
            answer=prompt.answer, n=n, min_version=version, attempt=attempt,
            prompt_ids=prompt.prompt_ids, data_source=prompt.data_source,
            ground_truth=prompt.ground_truth, extra_info=prompt.extra_info,
        )

    async def _write(self, tickets: Sequence[PromptTicket], event: TicketsIssued) -> None:
        """The tickets and the event that records them, in one fenced script."""
        items: list[tuple[str, Message]] = [(self.keys.prompts, t) for t in tickets]
        ids = await self.writer.write([*items, (self.keys.events, event)])
        self.writer.fold(event)
        now = time.monotonic()
        for t, entry_id in zip(tickets, ids, strict=False):
            index = ticket_index(t.ticket_id)
            assert index is not None
            self.ticket_entry[index] = entry_id
            self.issued_at[index] = now

    async def issue(self, version: int) -> None:
        """Issue what the sync window's staleness budget still allows (trainer.budget):
        right after a sync (or at the start) the window's new tickets, else nothing."""
        room = self.writer.state.ledger.room(self.capacity)
        first, n = self.writer.state.ledger.issued, self.cfg.rollout.n
        # A source with an end (verl data with trainer.total_epochs) issues no prompt past
        # it; check_data made sure the run's steps fit before it started.
        limit = getattr(self.prompts, "limit", None)
        if limit is not None:
            room = min(room, limit - first)
        if room <= 0:
            return
        tickets = [self._ticket(index, n, version) for index in range(first, first + room)]
        await self._write(tickets, TicketsIssued(ticket_ids=[t.ticket_id for t in tickets],
                                                 n=n, param_version=version))

    async def reissue(self, indices: Sequence[int], reason: str, version: int,
                      taken: Container[int]) -> None:
        """Issue a new attempt of open tickets not ``taken``, tagged with weights
        ``version``: the first complete answer of any attempt wins (partial groups of older
        attempts may still complete first: they stay)."""
        by_attempt: dict[int, list[OpenTicket]] = {}
        for index in sorted(set(indices)):
            ticket = self.writer.state.ledger.open.get(index)
            if ticket is not None and index not in taken:
                by_attempt.setdefault(ticket.attempt + 1, []).append(ticket)
        for attempt, opened in by_attempt.items():
            tickets = [self._ticket(t.index, t.n, version, attempt) for t in opened]
            await self._write(tickets, TicketsIssued(
                ticket_ids=[t.ticket_id for t in tickets], n=opened[0].n,
                param_version=version, attempt=attempt, reason=reason))
            self.reissued += len(tickets)

    async def close_dead(self, dead: Sequence[PromptTicket], taken: Container[int]) -> list[int]:
        """Tickets the rollouters dead-lettered (their rollouts kept failing): give them up
        and free their budget slots, unless a newer attempt is out. Returns the closed."""
        close = []
        for t in dead:
            index = ticket_index(t.ticket_id)
            ticket = self.writer.state.ledger.open.get(index) if index is not None else None
            if ticket is None or ticket.attempt != t.attempt or index in taken:
                continue
            close.append(t.ticket_id)
        if not close:
            return []
        await self.writer.publish(TicketsClosed(
            ticket_ids=close,
            reason=f"dead-lettered in {self.keys.dlq} after failed rollouts",
        ))
        await self.writer.publish(WarningRaised(
            source="trainer", code="tickets_dead_lettered",
            message=f"{len(close)} prompt ticket(s) failed too often and went to "
                    f"{self.keys.dlq} ({', '.join(close[:5])}); issuing new ones in their place",
        ))
        indices = [i for tid in close if (i := ticket_index(tid)) is not None]
        self.trained(indices)
        return indices

    async def reissue_lost(self, lost: Sequence[Sample], version: int,
                           taken: Container[int]) -> None:
        """Answers dead-lettered from the trainer's group: their tickets are answered again,
        once per attempt: only an answer of a ticket's latest attempt counts (the refusal
        that dead-lettered an invalid answer has already issued the next attempt, and the
        other responses of a lost group are the same loss)."""
        open_ = self.writer.state.ledger.open
        indices = {i for s in lost if (i := ticket_index(s.ticket_id)) is not None
                   and i in open_ and open_[i].attempt == s.attempt and i not in taken}
        if indices:
            await self.reissue(sorted(indices), "an answer was dead-lettered", version, taken)

    def expired(self, taken: Container[int]) -> list[int]:
        """Open tickets not ``taken`` unanswered for longer than the ticket lease."""
        lease, now = self.lease_s(), time.monotonic()
        return [i for i in self.writer.state.ledger.open
                if i not in taken and now - self.issued_at.get(i, now) > lease]

    async def reissue_expired(self, expired: list[int], live: Peers, version: int,
                              taken: Container[int]) -> None:
        """Reissue those of the ``expired`` tickets that are lost (lost with a crashed Redis
        tail, held by a dead rollouter or by a live one that makes no progress); ``live``:
        the rollouters alive now and their progress."""
        lost, stuck = await self._lost(expired, live)
        wedged = {i for tickets in stuck.values() for i in tickets}
        if stuck:
            await self._warn_stuck(stuck, live)
            await self.reissue(sorted(wedged), f"held by a rollouter without progress for "
                               f"{self.progress_bound():.0f} s", version, taken)
        rest = [i for i in lost if i not in wedged]
        if rest:
            await self.reissue(rest, f"unanswered for {self.lease_s():.0f} s (ticket lease)",
                               version, taken)

    async def _warn_stuck(self, stuck: Mapping[str, list[int]], live: Peers) -> None:
        """One warning per rollouter whose tickets are taken for want of progress."""
        now = time.monotonic()
        names = {RunKeys.rollouter_consumer(hb.rank): f"rollouter{hb.rank}"
                 for hb in live.heartbeats}
        for consumer, tickets in stuck.items():
            seen, name = live.progress[consumer], names.get(consumer, consumer)
            shown = ", ".join(ticket_id(i) for i in tickets[:8]) + (
                " ..." if len(tickets) > 8 else "")
            await self.writer.publish(WarningRaised(
                source="trainer", code="rollouter_no_progress",
                message=f"{name} (pid {seen.pid}) holds {len(tickets)} open ticket(s) "
                        f"({shown}) and its progress counter stayed at {seen.value} for "
                        f"{now - seen.since:.0f} s (bound {self.progress_bound():.0f} s: the "
                        "longest of the ticket lease, heartbeat.timeout_s and "
                        "rollout.reward_timeout_s) while its liveness key stays fresh: its "
                        "generation is wedged; the tickets are reissued, its late answers "
                        "dropped"))

    async def _lost(self, indices: list[int], live: Peers
                    ) -> tuple[list[int], dict[str, list[int]]]:
        """Of these tickets, those that are lost: gone from the prompts stream (a lost log
        tail, a trim), pending on a replica whose liveness key lapsed, or pending on a live
        one without progress for :meth:`progress_bound` (those also by holder: the second
        value). A ticket queued, held by a live rollouter that progresses (however slowly),
        or already acked (answered: its samples are on the way) keeps its lease. Tickets
        issued before this trainer started (entry unknown) are judged by time alone."""
        known = {i: self.ticket_entry[i] for i in indices if i in self.ticket_entry}
        if not known:
            return indices, {}
        alive = {RunKeys.rollouter_consumer(hb.rank) for hb in live.heartbeats}
        present = await self.bus.read_ids(self.keys.prompts, list(known.values()))
        owner = await self.bus.pending_owners(self.keys.prompts, ROLLOUTER_GROUP,
                                              10 * self.capacity + 100)
        held: dict[str, list[int]] = {}
        for i, e in known.items():
            if e in present and owner.get(e) in alive:
                held.setdefault(owner[e], []).append(i)
        now = time.monotonic()
        stuck = no_progress(held, {c: p.since for c, p in live.progress.items()}, now,
                            self.progress_bound())
        wedged = {i for tickets in stuck.values() for i in tickets}
        keep = {i for i, e in known.items()
                if e in present and (e not in owner or owner[e] in alive) and i not in wedged}
        for i in keep:
            self.issued_at[i] = now  # held: its lease starts again
        return [i for i in indices if i not in keep], stuck
