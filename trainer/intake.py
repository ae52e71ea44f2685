"""The trainer's intake: samples assembled into prompt groups, each read judged by a verdict.

A sample is accepted only as an answer of an *open* ticket of the ledger (trainer.ledger),
validated against it (trainer.validate); the first complete group of any attempt wins and
every other copy is a duplicate. :meth:`Intake.judge` decides and returns what to do, in
order; it writes nothing and reads no clock (the step core, trainer.core, turns the verdicts
into what the trainer writes: dead letters, acks, reissues, warnings), so the rules can be
tested without Redis.

Verdicts, per delivery:

- :class:`Refuse`: dead-letter it with the reason (not a Sample, a ticket never issued, an
  invalid answer). A sample that is no member of a real group (an attempt never issued, a
  rollouter that did not claim that attempt: trainer.claims) is refused alone; its group
  goes on. Any other invalid answer refuses its group whole (GRPO's advantages are relative
  within the group, so its other members are not trained either): the members gathered so
  far and those still to come are refused too, each naming the member and the check that
  failed. An invalid answer of a ticket's latest attempt also asks for the ticket to be
  answered again (``reissue``), once per attempt: the other responses of that group, and a
  bad answer of an older attempt (a newer one is out already), ask for nothing more;
- :class:`Duplicate`: ack and drop (a trained, closed or already answered ticket; a second
  copy of one response);
- :class:`Stale`: a complete group generated with weights older than ``max_staleness``
  allows: ack its entries, warn, reissue the ticket;
- :class:`Complete`: a group ready to train (queued in :attr:`Intake.ready`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec

from bus import Delivery
from runschema.messages import Sample
from trainer.claims import Claims
from trainer.ledger import Ledger, OpenTicket, ticket_id, ticket_index
from trainer.validate import check_sample, values_in_range

__all__ = ["INVALID_ANSWER", "NEVER_ISSUED", "NOT_A_SAMPLE", "REFUSED_ALONE", "Complete",
           "Duplicate", "Group", "Intake", "Refuse", "Stale", "Verdict"]

# What a refusal is counted as in the line that sums a read's refusals (bus.Refusal.kind):
# the reasons themselves name tickets, so a flood would be one kind per entry.
NOT_A_SAMPLE = "not a sample"
NEVER_ISSUED = "ticket never issued"
INVALID_ANSWER = "invalid answer"
REFUSED_ALONE = "stray answer (unclaimed, or of an attempt never issued)"


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

    def __init__(self, max_new_tokens: int, max_staleness: int,
                 reward_bounds: tuple[float, float] | None = None) -> None:
        self.max_new_tokens = max_new_tokens
        self.max_staleness = max_staleness
        self.reward_bounds = reward_bounds
        self.failed: dict[tuple[int, int], str] = {}
        """(ticket, attempt) -> why its group was refused whole: its later members too."""
        self.alone: set[tuple[str, int, int]] = set()
        """(sample id, attempt, rank) of answers refused alone: their dead letters, read
        back, ask for no new attempt (the group they claimed to join goes on)."""
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
        for key in [k for k in self.failed if k[0] == index]:
            del self.failed[key]

    def trained(self, groups: Sequence[Group]) -> None:
        """These groups' tickets were trained (their StepFinished is in the log)."""
        for g in groups:
            self.taken.discard(g.index)
            self.replaced.pop(g.index, None)
            self.drop_partial(g.index)
        if self.alone:  # their dead letters have long been read back
            done = {ticket_id(g.index) for g in groups}
            self.alone = {k for k in self.alone if k[0].rsplit("/", 1)[0] not in done}

    def queued_groups(self) -> int:
        """Groups held: ready, and still being answered."""
        return len(self.ready) + len(self.groups)

    def queued_samples(self) -> int:
        """Samples held: in ready groups and in groups still being answered."""
        return (sum(len(g.samples) for g in self.ready)
                + sum(len(g.samples) for g in self.groups.values()))

    def judge(self, deliveries: Sequence[Delivery], ledger: Ledger, version: int,
              vocab_size: int | None, max_len: int | None, *, claims: Claims | None = None,
              digest: Callable[[int], str] | None = None) -> list[Verdict]:
        """The verdicts on one read, in order. Token ids and log-probs of the read are
        checked together first (values_in_range), each sample's alone only if that fails.
        ``claims``: which rollouters may answer which ticket (None: not judged);
        ``digest``: a ticket's prompt digest (None, or "": not checked)."""
        checked = values_in_range([d.msg for d in deliveries if isinstance(d.msg, Sample)],
                                  vocab_size)
        verdicts: list[Verdict] = []
        for d in deliveries:
            verdicts.extend(self._judge(d, ledger, version, vocab_size, max_len, checked,
                                        claims, digest))
        return verdicts

    def _judge(self, delivery: Delivery, ledger: Ledger, version: int, vocab_size: int | None,
               max_len: int | None, values_checked: bool, claims: Claims | None,
               digest: Callable[[int], str] | None) -> list[Verdict]:
        msg = delivery.msg
        if not isinstance(msg, Sample):
            return [self._refuse(delivery, f"expected a Sample, got {type(msg).__name__}",
                                 kind=NOT_A_SAMPLE)]
        index = ticket_index(msg.ticket_id)
        if index is None or index >= ledger.issued:
            return [self._refuse(delivery, f"ticket {msg.ticket_id!r} was never issued",
                                 kind=NEVER_ISSUED)]
        ticket = ledger.open.get(index)
        if ticket is None or index in self.taken:
            if ticket is None:
                self.replaced.pop(index, None)
            # Trained already, given up, or another copy won: a duplicate, dropped.
            return [Duplicate([delivery.id])]
        alone = self._stray(msg, ticket, claims)
        if alone is not None:
            self.alone.add((msg.sample_id, msg.attempt, msg.rank))
            return [self._refuse(delivery, f"{msg.sample_id} refused alone: {alone}",
                                 kind=REFUSED_ALONE)]
        key = (index, msg.attempt)
        failed = self.failed.get(key)
        if failed is not None:
            return [self._refuse(delivery, failed, kind=INVALID_ANSWER)]
        problem = check_sample(msg, ticket, version=version, max_new_tokens=self.max_new_tokens,
                               max_len=max_len, vocab_size=vocab_size,
                               values_checked=values_checked, reward_bounds=self.reward_bounds,
                               digest=digest(index) if digest is not None else "")
        if problem is not None:
            return self._refuse_group(delivery, msg, ticket, problem)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(index, msg.attempt, ticket.n, {})
        if msg.index in group.samples:
            return [Duplicate([delivery.id])]  # a duplicate publication of the same response
        group.samples[msg.index] = (delivery.id, msg)
        return [self._completed(group, version)] if group.complete else []

    @staticmethod
    def _stray(s: Sample, ticket: OpenTicket, claims: Claims | None) -> str | None:
        """Why ``s`` belongs to no group of ``ticket`` (refused alone, its group untouched):
        an attempt never issued, or a rollouter that did not claim the attempt."""
        if s.attempt > ticket.attempt:
            return (f"attempt {s.attempt} of {s.ticket_id} was never issued (latest "
                    f"{ticket.attempt})")
        return None if claims is None else claims.problem(s)

    def _refuse_group(self, delivery: Delivery, s: Sample, ticket: OpenTicket, problem: str
                      ) -> list[Verdict]:
        """``s`` is invalid: its attempt's group is refused whole (its gathered members
        now, the rest as they come), and the ticket answered again (once per attempt)."""
        index = ticket.index
        why = f"invalid answer of {s.ticket_id}: {s.sample_id}: {problem}"
        member = (f"group of {s.ticket_id} attempt {s.attempt} refused whole: member "
                  f"{s.sample_id}: {problem}")
        self.failed[(index, s.attempt)] = member
        out: list[Verdict] = [self._refuse(delivery, why, reissue=self._replacement(
            index, s.attempt, ticket.attempt), kind=INVALID_ANSWER)]
        # That attempt's group cannot be trained; other attempts' partial groups may.
        group = self.groups.pop((index, s.attempt), None)
        for entry_id, other in ([] if group is None else group.ordered()):
            out.append(self._refuse(Delivery(entry_id, other, 1, delivery.stream), member,
                                    kind=INVALID_ANSWER))
        return out

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
