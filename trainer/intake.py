"""The trainer's intake: samples assembled into prompt groups, each read judged by a verdict.

A sample is accepted only as an answer of an *open* ticket of the ledger (trainer.ledger),
validated against it (trainer.validate); the first complete group of any attempt wins and
every other copy is a duplicate. :meth:`Intake.judge` decides and returns what to do, in
order; it writes nothing and reads no clock (the step core, trainer.core, turns the verdicts
into what the trainer writes: dead letters, acks, reissues, warnings), so the rules can be
tested without Redis.

Verdicts, per delivery:

- :class:`Refuse`: dead-letter it with the reason (not a Sample, a ticket never issued, an
  invalid answer). An invalid answer of a ticket's latest attempt also asks for the ticket
  to be answered again (``reissue``), once per attempt: the other responses of that group,
  and a bad answer of an older attempt (a newer one is out already), ask for nothing more;
- :class:`Duplicate`: ack and drop (a trained, closed or already answered ticket; a second
  copy of one response);
- :class:`Stale`: a complete group generated with weights older than ``max_staleness``
  allows: ack its entries, warn, reissue the ticket;
- :class:`Complete`: a group ready to train (queued in :attr:`Intake.ready`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from bus import Delivery
from runschema.messages import Sample
from trainer.ledger import Ledger, ticket_id, ticket_index
from trainer.validate import check_sample, values_in_range

__all__ = ["INVALID_ANSWER", "NEVER_ISSUED", "NOT_A_SAMPLE", "Complete", "Duplicate", "Group",
           "Intake", "Refuse", "Stale", "Verdict"]

# What a refusal is counted as in the line that sums a read's refusals (bus.Refusal.kind):
# the reasons themselves name tickets, so a flood would be one kind per entry.
NOT_A_SAMPLE = "not a sample"
NEVER_ISSUED = "ticket never issued"
INVALID_ANSWER = "invalid answer"


class Group(msgspec.Struct):
    """The responses of one attempt of one ticket gathered so far (entry ids for the ack)."""

    index: int
    attempt: int
    n: int
    samples: dict[int, tuple[str, Sample]] = {}

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.n

    def ordered(self) -> list[tuple[str, Sample]]:
        return [pair for _, pair in sorted(self.samples.items())]

    def entry_ids(self) -> list[str]:
        return [eid for eid, _ in self.samples.values()]

    def oldest_version(self) -> int:
        return min(s.min_version for _, s in self.samples.values())

    def possibly_stale(self, version: int) -> bool:
        """Generated (in part) with weights older than ``version``."""
        return any(s.min_version < version for _, s in self.samples.values())


class Refuse(NamedTuple):
    delivery: Delivery
    reason: str
    reissue: int | None = None  # the ticket to answer again
    kind: str = ""  # what the refusal is counted as in the trainer's log line (bus.Refusal)


class Duplicate(NamedTuple):
    entry_ids: list[str]


class Stale(NamedTuple):
    group: Group
    message: str


class Complete(NamedTuple):
    group: Group


Verdict = Refuse | Duplicate | Stale | Complete


class Intake:
    """Groups being assembled, groups ready to train, and the tickets they answer."""

    def __init__(self, max_new_tokens: int, max_staleness: int) -> None:
        self.max_new_tokens = max_new_tokens
        self.max_staleness = max_staleness
        self.groups: dict[tuple[int, int], Group] = {}
        self.ready: list[Group] = []
        self.taken: set[int] = set()
        """Tickets whose winning group is ready or in a step not finished yet."""
        self.replaced: dict[int, int] = {}
        """Ticket -> its attempt whose invalid answer asked for a new one (once each)."""
        self.refused = 0
        self.discarded = 0

    def drop_partial(self, index: int) -> None:
        """Forget every partly answered attempt of ticket ``index``."""
        for key in [k for k in self.groups if k[0] == index]:
            del self.groups[key]

    def trained(self, groups: Sequence[Group]) -> None:
        """These groups' tickets were trained (their StepFinished is in the log)."""
        for g in groups:
            self.taken.discard(g.index)
            self.replaced.pop(g.index, None)

    def queued_samples(self) -> int:
        """Samples held: in ready groups and in groups still being answered."""
        return (sum(len(g.samples) for g in self.ready)
                + sum(len(g.samples) for g in self.groups.values()))

    def judge(self, deliveries: Sequence[Delivery], ledger: Ledger, version: int,
              vocab_size: int | None, max_len: int | None) -> list[Verdict]:
        """The verdicts on one read, in order. Token ids and log-probs of the read are
        checked together first (values_in_range), each sample's alone only if that fails."""
        checked = values_in_range([d.msg for d in deliveries if isinstance(d.msg, Sample)],
                                  vocab_size)
        verdicts: list[Verdict] = []
        for d in deliveries:
            verdict = self._judge(d, ledger, version, vocab_size, max_len, checked)
            if verdict is not None:
                verdicts.append(verdict)
        return verdicts

    def _judge(self, delivery: Delivery, ledger: Ledger, version: int, vocab_size: int | None,
               max_len: int | None, values_checked: bool) -> Verdict | None:
        msg = delivery.msg
        if not isinstance(msg, Sample):
            return self._refuse(delivery, f"expected a Sample, got {type(msg).__name__}",
                                kind=NOT_A_SAMPLE)
        index = ticket_index(msg.ticket_id)
        if index is None or index >= ledger.issued:
            return self._refuse(delivery, f"ticket {msg.ticket_id!r} was never issued",
                                kind=NEVER_ISSUED)
        ticket = ledger.open.get(index)
        if ticket is None or index in self.taken:
            if ticket is None:
                self.replaced.pop(index, None)
            # Trained already, given up, or another copy won: a duplicate, dropped.
            return Duplicate([delivery.id])
        problem = check_sample(msg, ticket, version=version, max_new_tokens=self.max_new_tokens,
                               max_len=max_len, vocab_size=vocab_size,
                               values_checked=values_checked)
        if problem is not None:
            # That attempt's group cannot complete; other attempts' partial groups may.
            self.groups.pop((index, msg.attempt), None)
            return self._refuse(delivery, f"invalid answer of {msg.ticket_id}: {problem}",
                                reissue=self._replacement(index, msg.attempt, ticket.attempt),
                                kind=INVALID_ANSWER)
        key = (index, msg.attempt)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(index, msg.attempt, ticket.n, {})
        if msg.index in group.samples:
            return Duplicate([delivery.id])  # a duplicate publication of the same response
        group.samples[msg.index] = (delivery.id, msg)
        return self._completed(group, version) if group.complete else None

    def _replacement(self, index: int, answered: int, latest: int) -> int | None:
        """The ticket to answer again after an invalid answer of attempt ``answered`` of
        ticket ``index`` (whose latest attempt is ``latest``): only for the latest attempt
        (or one claiming to be newer) and only once for it, so one bad group gives one new
        attempt. The verdicts of one read are judged before any is applied, hence the
        memory: the ledger moves to the next attempt only when the reissue is written."""
        if answered < latest or self.replaced.get(index) == latest:
            return None
        self.replaced[index] = latest
        return index

    def _refuse(self, delivery: Delivery, reason: str, reissue: int | None = None, *,
                kind: str) -> Refuse:
        self.refused += 1
        return Refuse(delivery, reason, reissue, kind)

    def _completed(self, group: Group, version: int) -> Stale | Complete:
        """The first complete answer wins; every other attempt's partial copy is dropped
        (their entries are acked when they are read again, as duplicates)."""
        self.drop_partial(group.index)
        oldest = group.oldest_version()
        if version - oldest > self.max_staleness:
            # Only a ticket held far longer than its peers gets here; training on it would
            # break the staleness bound, so it is answered again with current weights.
            self.discarded += 1
            return Stale(group, f"ticket t{group.index} generated with weights {oldest} is "
                                f"{version - oldest} versions old (max {self.max_staleness}); "
                                "reissued")
        self.taken.add(group.index)
        self.ready.append(group)
        return Complete(group)

    def waiting_for(self, ledger: Ledger, need: int, step: int, version: int,
                    rollouters: str) -> str:
        """What a trainer gathering ``step`` waits for, in words (stall warnings, failures)."""
        waiting = sorted(i for i in ledger.open if i not in self.taken)
        partial = [g for g in self.groups.values() if not g.complete]
        versions = sorted({ledger.open[i].version for i in waiting})
        shown = ", ".join(ticket_id(i) for i in waiting[:8]) + (" ..." if len(waiting) > 8 else "")
        return (f"{len(self.ready)}/{need} groups ready for step {step}; {len(waiting)} open "
                f"ticket(s) unanswered ({shown}; weights versions {versions}; {len(partial)} "
                f"partly answered); trainer holds weights v{version}; rollouters alive: "
                f"{rollouters}")
