"""Ticket dispatch: prompt tickets issued within the staleness budget, their leases, reissues.

Pure: the decisions return the tickets to write (:class:`~trainer.actions.IssueTickets`: the
tickets with the TicketsIssued that records them, written in one fenced script by the
trainer's shell) and the events to publish; the ledger (trainer.ledger) they are decided on
is an argument. The trainer is the only issuer, so the budget (trainer.budget) is exact with
any number of rollouters.

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
answer (trainer.intake) and the dead letter it becomes (:meth:`Dispatch.lost_answers`) both
replace only the attempt they belong to, so one bad group gives one new attempt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Container, Mapping, Sequence

from bus import RunKeys
from runconfig import Config
from runschema.messages import (
    Heartbeat,
    PromptTicket,
    Sample,
    TicketsClosed,
    TicketsIssued,
    WarningRaised,
    prompt_digest,
)
from tasks import Prompt, PromptSource
from trainer.actions import Holders, IssueTickets
from trainer.budget import ticket_budget
from trainer.claims import Claims
from trainer.health import Progress
from trainer.ledger import Ledger, OpenTicket, ticket_id, ticket_index

__all__ = ["ROLLOUTER_GROUP", "Dispatch", "no_progress"]

ROLLOUTER_GROUP = "rollouter"
"""The prompts stream's consumer group (every rollouter replica is a member)."""


def no_progress(held: Mapping[str, Collection[int]], since: Mapping[str, float], now: float,
                bound: float) -> dict[str, list[int]]:
    """The rollouters (consumer names) that hold tickets and whose progress counter has not
    changed for longer than ``bound`` seconds at ``now``, with the tickets they hold.
    ``held``: the tickets pending on each live rollouter; ``since``: when each one's counter
    last changed (trainer.health.observe_progress). A rollouter whose progress is unknown
    (it reports none) is never judged: liveness alone keeps its tickets, as before."""
    return {consumer: sorted(tickets) for consumer, tickets in held.items()
            if tickets and consumer in since and now - since[consumer] > bound}


def _shown(tickets: Sequence[int]) -> str:
    return ", ".join(ticket_id(i) for i in tickets[:8]) + (" ..." if len(tickets) > 8 else "")


Encode = Callable[[str], Sequence[int]]
"""A text prompt's token ids as the rollouters encode it (``tokenizer.encode(text, bos=True)``)."""


class Dispatch:
    """Issues, leases and reissues the run's prompt tickets; ``dlq``: the dead-letter
    stream (named in what the trainer says of tickets that went there); ``encode``: how a
    text prompt becomes token ids, for its digest (None: text prompts carry none, only
    verl data's token ids are digested)."""

    def __init__(self, cfg: Config, prompts: PromptSource, dlq: str, *,
                 encode: Encode | None = None) -> None:
        self.cfg = cfg
        self.prompts = prompts
        self.dlq = dlq
        self.encode = encode
        self.digests: dict[int, str] = {}  # ticket -> its prompt's digest (open tickets)
        self.claims = Claims()
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
        whose work stands still that long is treated as one that fell silent), one
        reward call's timeout (scoring moves the counter once per call) and, with
        conversations, one tool call's (a tool call ended moves it too: a replica whose
        conversations all wait on a slow tool is slow, not dead)."""
        mt = self.cfg.rollout.multi_turn
        return max(self.lease_s(), self.cfg.heartbeat.timeout_s,
                   self.cfg.rollout.reward_timeout_s, mt.tool_timeout_s if mt.enable else 0.0)

    def owners_to_read(self) -> int:
        """How many pending entries of the rollouters' group a lease check reads the owners
        of (the oldest first: every open ticket's, with room for validation requests)."""
        return 10 * self.capacity + 100

    # ------------------------------------------------------------------ leases

    def answered(self, index: int, at: float) -> None:
        """Ticket ``index`` got a complete answer at ``at`` (monotonic): its answer time
        counts towards the automatic lease."""
        self.answer_s.append(at - self.issued_at.get(index, at))

    def trained(self, indices: Sequence[int]) -> None:
        """These tickets were trained: no lease to watch any more."""
        for index in indices:
            self.issued_at.pop(index, None)
            self.ticket_entry.pop(index, None)
            self.digests.pop(index, None)
        self.claims.forget(indices)

    def restart_leases(self, ledger: Ledger, now: float) -> None:
        """When the trainer (re)starts: open tickets are still out (pending, unread, or
        lost with a Redis tail); their leases start ``now``."""
        self.issued_at = dict.fromkeys(ledger.open, now)

    def written(self, tickets: Sequence[PromptTicket], entry_ids: Sequence[str],
                now: float) -> None:
        """These tickets were written at these prompts entries at ``now``: their leases
        start."""
        for t, entry_id in zip(tickets, entry_ids, strict=False):
            index = ticket_index(t.ticket_id)
            assert index is not None
            self.ticket_entry[index] = entry_id
            self.issued_at[index] = now
            self.claims.issued(index, t.attempt)

    def expired(self, ledger: Ledger, taken: Container[int], now: float) -> list[int]:
        """Open tickets not ``taken`` unanswered for longer than the ticket lease."""
        lease = self.lease_s()
        return [i for i in ledger.open
                if i not in taken and now - self.issued_at.get(i, now) > lease]

    def entries_of(self, indices: Sequence[int]) -> list[str]:
        """The prompts entries of these tickets' latest attempts, where known."""
        return [self.ticket_entry[i] for i in indices if i in self.ticket_entry]

    # ------------------------------------------------------------------ tickets

    def ticket(self, index: int, n: int, version: int, attempt: int = 0) -> PromptTicket:
        """Ticket ``index`` (its prompt from the task), for weights ``version``."""
        prompt = self.prompts.get(index)
        return PromptTicket(
            ticket_id=ticket_id(index), prompt_id=prompt.prompt_id, prompt=prompt.prompt,
            answer=prompt.answer, n=n, min_version=version, attempt=attempt,
            prompt_ids=prompt.prompt_ids, data_source=prompt.data_source,
            ground_truth=prompt.ground_truth, extra_info=prompt.extra_info,
            prompt_digest=self._digest(index, prompt),
            agent_name="" if prompt.agent_name == "single_turn_agent" else prompt.agent_name,
        )

    def digest(self, index: int) -> str:
        """The prompt digest of ticket ``index`` (what its ticket carries): kept from its
        issue, or, for a ticket issued before this incarnation, made again from the prompt
        source (deterministic: the same index gives the same prompt)."""
        known = self.digests.get(index)
        return known if known is not None else self._digest(index, self.prompts.get(index))

    def _digest(self, index: int, prompt: Prompt) -> str:
        """Once per ticket (reissues reuse it): verl data's token ids hashed, or a text
        prompt encoded first as the rollouters encode it."""
        known = self.digests.get(index)
        if known is None:
            if prompt.prompt_ids is not None:
                known = prompt_digest(prompt.prompt_ids)
            elif self.encode is not None:
                try:
                    known = prompt_digest(self.encode(prompt.prompt))
                except (KeyError, ValueError):  # not encodable: the rollouters fail it too
                    known = ""
            else:
                known = ""
            self.digests[index] = known
        return known

    def issue(self, ledger: Ledger, version: int) -> IssueTickets | None:
        """What the sync window's staleness budget still allows (trainer.budget): right
        after a sync (or at the start) the window's new tickets, else nothing."""
        room = ledger.room(self.capacity)
        first, n = ledger.issued, self.cfg.rollout.n
        # A source with an end (verl data with trainer.total_epochs) issues no prompt past
        # it; check_data made sure the run's steps fit before it started.
        limit = getattr(self.prompts, "limit", None)
        if limit is not None:
            room = min(room, limit - first)
        if room <= 0:
            return None
        tickets = [self.ticket(index, n, version) for index in range(first, first + room)]
        return IssueTickets(tickets, TicketsIssued(ticket_ids=[t.ticket_id for t in tickets],
                                                   n=n, param_version=version))

    def reissue(self, ledger: Ledger, indices: Sequence[int], reason: str, version: int,
                taken: Container[int]) -> list[IssueTickets]:
        """A new attempt of open tickets not ``taken``, tagged with weights ``version``: the
        first complete answer of any attempt wins (partial groups of older attempts may
        still complete first: they stay). One write per attempt number."""
        by_attempt: dict[int, list[OpenTicket]] = {}
        for index in sorted(set(indices)):
            ticket = ledger.open.get(index)
            if ticket is not None and index not in taken:
                by_attempt.setdefault(ticket.attempt + 1, []).append(ticket)
        out = []
        for attempt, opened in by_attempt.items():
            tickets = [self.ticket(t.index, t.n, version, attempt) for t in opened]
            out.append(IssueTickets(tickets, TicketsIssued(
                ticket_ids=[t.ticket_id for t in tickets], n=opened[0].n,
                param_version=version, attempt=attempt, reason=reason)))
            self.reissued += len(tickets)
        return out

    def close_dead(self, ledger: Ledger, dead: Sequence[PromptTicket], taken: Container[int]
                   ) -> tuple[list[int], list[TicketsClosed | WarningRaised]]:
        """Tickets the rollouters dead-lettered (their rollouts kept failing): give them up
        and free their budget slots, unless a newer attempt is out. Returns the closed and
        the events that say so (TicketsClosed, then a warning), each its own write."""
        close = []
        for t in dead:
            index = ticket_index(t.ticket_id)
            ticket = ledger.open.get(index) if index is not None else None
            if ticket is None or ticket.attempt != t.attempt or index in taken:
                continue
            close.append(t.ticket_id)
        if not close:
            return [], []
        indices = [i for tid in close if (i := ticket_index(tid)) is not None]
        self.trained(indices)
        return indices, [
            TicketsClosed(ticket_ids=close,
                          reason=f"dead-lettered in {self.dlq} after failed rollouts"),
            WarningRaised(source="trainer", code="tickets_dead_lettered",
                          message=f"{len(close)} prompt ticket(s) failed too often and went to "
                                  f"{self.dlq} ({', '.join(close[:5])}); issuing new ones in "
                                  "their place")]

    @staticmethod
    def lost_answers(ledger: Ledger, lost: Sequence[Sample], taken: Container[int]) -> list[int]:
        """Answers dead-lettered from the trainer's group: the tickets to answer again, once
        per attempt: only an answer of a ticket's latest attempt counts (the refusal that
        dead-lettered an invalid answer has already issued the next attempt, and the other
        responses of a lost group are the same loss)."""
        open_ = ledger.open
        return sorted({i for s in lost if (i := ticket_index(s.ticket_id)) is not None
                       and i in open_ and open_[i].attempt == s.attempt and i not in taken})

    # ------------------------------------------------------------------ lost tickets

    def lost(self, holders: Holders, alive: Collection[str], progress: Mapping[str, Progress],
             now: float) -> tuple[list[int], dict[str, list[int]]]:
        """Of the expired tickets ``holders`` names, those that are lost: gone from the
        prompts stream (a lost log tail, a trim), pending on a replica whose liveness key
        lapsed (not ``alive``), or pending on a live one without ``progress`` for
        :meth:`progress_bound` (those also by holder: the second value). A ticket queued,
        held by a live rollouter that progresses (however slowly), or already acked
        (answered: its samples are on the way) keeps its lease: it starts again ``now``.
        Tickets issued before this trainer started (entry unknown) are judged by time
        alone."""
        indices = list(holders.tickets)
        known = {i: self.ticket_entry[i] for i in indices if i in self.ticket_entry}
        if not known:
            return indices, {}
        present, owner = holders.present, holders.owners
        held: dict[str, list[int]] = {}
        for i, e in known.items():
            if e in present and owner.get(e) in alive:
                held.setdefault(owner[e], []).append(i)
        stuck = no_progress(held, {c: p.since for c, p in progress.items()}, now,
                            self.progress_bound())
        wedged = {i for tickets in stuck.values() for i in tickets}
        keep = {i for i, e in known.items()
                if e in present and (e not in owner or owner[e] in alive) and i not in wedged}
        for i in keep:
            self.issued_at[i] = now  # held: its lease starts again
        return [i for i in indices if i not in keep], stuck

    def stuck_warnings(self, stuck: Mapping[str, list[int]], rollouters: Sequence[Heartbeat],
                       progress: Mapping[str, Progress], now: float) -> list[WarningRaised]:
        """One warning per rollouter whose tickets are taken for want of progress."""
        names = {RunKeys.rollouter_consumer(hb.rank): f"rollouter{hb.rank}" for hb in rollouters}
        out = []
        for consumer, tickets in stuck.items():
            seen, name = progress[consumer], names.get(consumer, consumer)
            out.append(WarningRaised(
                source="trainer", code="rollouter_no_progress",
                message=f"{name} (pid {seen.pid}) holds {len(tickets)} open ticket(s) "
                        f"({_shown(tickets)}) and its progress counter stayed at {seen.value} "
                        f"for {now - seen.since:.0f} s (bound {self.progress_bound():.0f} s: "
                        "the longest of the ticket lease, heartbeat.timeout_s and "
                        "rollout.reward_timeout_s) while its liveness key stays fresh: its "
                        "generation is wedged; the tickets are reissued, its late answers "
                        "dropped"))
        return out
