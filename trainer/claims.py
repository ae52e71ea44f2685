"""Who may answer a ticket: the rollouters that claimed it, per the rollouters' log.

Pure (no Redis). Every rollouter shares one ACL user, so Redis cannot tell which replica
wrote a sample; what it does fix is which replica a ticket was delivered to (the prompts
group's member ``rollouter-{rank}``), and the replica states that in its log as
:class:`~runschema.messages.TicketsClaimed` before it generates. A sample names the replica
that made it (``rank``); :meth:`Claims.problem` refuses one whose replica never claimed
that attempt of its ticket: a rollouter answering another's ticket, or one nobody holds.

Only attempts this trainer incarnation issued are judged: the trainer follows the
rollouters' log from where it started, so their claims all reach it, while the claims of a
ticket issued before a restart may lie before that point (those answers are judged by the
other checks alone). A claim is stated before the samples that answer it, and the shell
reads the log after each read of samples (trainer.app), so an honest answer never arrives
ahead of its claim. A replica that lies about its rank passes this check: telling replicas
apart needs one ACL user each (docs/architecture.md, "Samples checked against their
ticket").
"""

from __future__ import annotations

from collections.abc import Iterable

from runschema.messages import Sample, TicketsClaimed
from trainer.ledger import ticket_index

__all__ = ["Claims"]


class Claims:
    """The ticket attempts this incarnation issued and the ranks that claimed each."""

    def __init__(self) -> None:
        self.watched: dict[int, set[int]] = {}
        """Ticket -> the attempts of it written by this incarnation (their claims follow)."""
        self.holders: dict[tuple[int, int], set[int]] = {}
        """(ticket, attempt) -> the ranks that claimed it (a reclaim adds a second)."""

    def issued(self, index: int, attempt: int) -> None:
        """Attempt ``attempt`` of ticket ``index`` was written: its answers are judged."""
        self.watched.setdefault(index, set()).add(attempt)

    def claimed(self, msg: TicketsClaimed) -> None:
        """A replica's claim, as its log states it (claims of tickets not watched, or
        malformed, change nothing)."""
        for tid, attempt in zip(msg.ticket_ids, msg.attempts, strict=False):
            index = ticket_index(tid)
            if index is not None and attempt in self.watched.get(index, ()):
                self.holders.setdefault((index, attempt), set()).add(msg.rank)

    def forget(self, indices: Iterable[int]) -> None:
        """These tickets were trained or given up: nothing of theirs is judged any more."""
        for index in indices:
            for attempt in self.watched.pop(index, ()):
                self.holders.pop((index, attempt), None)

    def problem(self, s: Sample) -> str | None:
        """Why ``s`` may not answer its ticket: its rollouter did not claim that attempt
        (None: it did, or the attempt is not one this incarnation issued)."""
        index = ticket_index(s.ticket_id)
        if index is None or s.attempt not in self.watched.get(index, ()):
            return None
        ranks = self.holders.get((index, s.attempt), set())
        if s.rank in ranks:
            return None
        held = (f"claimed by rollouter {', '.join(map(str, sorted(ranks)))}" if ranks
                else "claimed by no rollouter")
        return (f"rollouter {s.rank} answered attempt {s.attempt} of {s.ticket_id}, {held} "
                "(holder check)")
