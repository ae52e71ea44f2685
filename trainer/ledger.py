"""The ticket ledger: which prompt tickets are open, folded from the events log.

Pure (no Redis, no torch). A ticket ``t{i}`` is *open* from the :class:`TicketsIssued` that
issues it until the :class:`StepFinished` that trains one of its answers or the
:class:`TicketsClosed` that gives it up. A lease reissue (``attempt > 0``) keeps it open with
a newer attempt and weights version; the first complete answer of any attempt wins, every
other copy is a duplicate. Open tickets are what the staleness budget counts, so a resume
restores the exact budget, and the ledger's size is bounded by the budget, not by the run.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from runschema.messages import Message, StepFinished, TicketsClosed, TicketsIssued

__all__ = ["Ledger", "OpenTicket", "apply", "fold", "refusal", "ticket_id", "ticket_index",
           "ticket_of_sample"]


def ticket_id(index: int) -> str:
    """The id of ticket number ``index``."""
    return f"t{index}"


def ticket_index(tid: str) -> int | None:
    """The number of ticket ``tid`` (``"t12"`` -> 12), or None for a malformed id."""
    if len(tid) < 2 or tid[0] != "t" or not tid[1:].isdigit():
        return None
    return int(tid[1:])


def ticket_of_sample(sample_id: str) -> int | None:
    """The ticket number of sample ``"t12/3"``."""
    return ticket_index(sample_id.rsplit("/", 1)[0])


class OpenTicket(msgspec.Struct, frozen=True):
    """An issued, not yet trained ticket: its size, latest attempt and that attempt's
    weights version (the ``min_version`` a rollouter must hold)."""

    index: int
    n: int
    attempt: int
    version: int


class Ledger(msgspec.Struct, frozen=True):
    """``issued``: tickets ever issued (ids ``t0 .. t{issued-1}``); ``open``: by index;
    ``window``: tickets counted against the staleness budget of the current sync window
    (trainer.budget): reset at each weight sync to the open ones, one more per new ticket;
    ``version``: the weights version after the last finished step (a change is a sync)."""

    issued: int = 0
    open: dict[int, OpenTicket] = {}
    window: int = 0
    version: int = 0
    given_up: dict[int, OpenTicket] = {}
    """Tickets a TicketsClosed gave up (the latest :data:`GIVEN_UP_KEPT`): a StepFinished
    that trains one of them anyway is believed over the close (:func:`_trained_refusal`)."""

    @property
    def outstanding(self) -> int:
        return len(self.open)

    @property
    def closed(self) -> int:
        return self.issued - len(self.open)

    def room(self, budget: int) -> int:
        """New tickets the sync window's staleness budget allows now (trainer.budget)."""
        return max(0, budget - max(self.window, len(self.open)))


GIVEN_UP_KEPT = 1024
"""Given-up tickets the ledger remembers (the trainer gives up only tickets whose rollouts
kept failing: a handful in a run; the bound keeps a flood of closes from growing it)."""


def _close(ledger: Ledger, indices: Iterable[int | None], *, untrained: bool = False
           ) -> Ledger:
    wanted = {i for i in indices if i is not None}
    drop = {i for i in wanted if i in ledger.open}
    # A given-up ticket trained after all is no longer given up.
    given_up = ({i: t for i, t in ledger.given_up.items() if i not in wanted}
                if not untrained and wanted & ledger.given_up.keys() else ledger.given_up)
    if not drop:
        return ledger if given_up is ledger.given_up else msgspec.structs.replace(
            ledger, given_up=given_up)
    opened = {i: t for i, t in ledger.open.items() if i not in drop}
    if untrained:
        given_up = {**ledger.given_up, **{i: ledger.open[i] for i in sorted(drop)}}
        while len(given_up) > GIVEN_UP_KEPT:
            given_up.pop(next(iter(given_up)))
    # A ticket given up without an answer generated no sample for the window.
    window = max(0, ledger.window - len(drop)) if untrained else ledger.window
    return msgspec.structs.replace(ledger, open=opened, window=window, given_up=given_up)


def _trained_refusal(ledger: Ledger, msg: StepFinished) -> str | None:
    """Why a StepFinished cannot be a step this ledger's tickets were answered for."""
    ids = msg.sample_ids
    if not ids:
        return f"StepFinished({msg.step}) trained no sample (a step trains a batch)"
    if len(set(ids)) != len(ids):
        return f"StepFinished({msg.step}) names a sample twice"
    if msg.entry_ids and len(msg.entry_ids) != len(ids):
        return (f"StepFinished({msg.step}) has {len(msg.entry_ids)} entry ids for "
                f"{len(ids)} samples")
    for sid in ids:
        index = ticket_of_sample(sid)
        # A step that trained a given-up ticket is believed over the close: only the
        # trainer writes both, and a trainer never trains what it gave up, so the close is
        # the one that was not its own (a forgery by a user the ACL cannot stop: its step
        # names samples the rollouters' answers hold, the close names nothing to check).
        ticket = None if index is None else (ledger.open.get(index)
                                             or ledger.given_up.get(index))
        sample = sid.rsplit("/", 1)[-1]
        if ticket is None or not sample.isdigit() or int(sample) >= ticket.n:
            return (f"StepFinished({msg.step}) trained {sid!r}, not an answer of an open "
                    "ticket")
    return None


def _closed_refusal(ledger: Ledger, msg: TicketsClosed) -> str | None:
    """Why a TicketsClosed contradicts the ledger. The trainer closes only open tickets; a
    copy of its write (at-least-once) names only tickets that copy closed: both fold."""
    indices = [ticket_index(tid) for tid in msg.ticket_ids]
    never = [tid for tid, i in zip(msg.ticket_ids, indices, strict=True)
             if i is None or i >= ledger.issued]
    if never:
        return f"TicketsClosed names tickets never issued: {never[:3]}"
    opened = [i in ledger.open for i in indices]
    if any(opened) and not all(opened):
        shut = [tid for tid, o in zip(msg.ticket_ids, opened, strict=True) if not o]
        return f"TicketsClosed names open tickets and tickets closed already: {shut[:3]}"
    return None


def refusal(ledger: Ledger, msg: Message) -> str | None:
    """Why ``msg`` contradicts the ledger (it must not be folded), or None. A StepFinished
    must train answers of open tickets (a non-empty batch, each sample ``t{i}/{j}`` of an
    open ticket ``t{i}`` with ``j < n``); a TicketsClosed may close only tickets that are
    open (or, a copy of one already folded, only tickets it closed)."""
    match msg:
        case StepFinished():
            return _trained_refusal(ledger, msg)
        case TicketsClosed():
            return _closed_refusal(ledger, msg)
    return None


def apply(ledger: Ledger, msg: Message) -> Ledger:
    """Fold one event into the ledger; other events, and those :func:`refusal` refuses,
    change nothing."""
    if refusal(ledger, msg) is not None:
        return ledger
    return _apply(ledger, msg)


def _apply(ledger: Ledger, msg: Message) -> Ledger:
    match msg:
        case TicketsIssued(ticket_ids=ids, n=n, param_version=version, attempt=attempt):
            opened = dict(ledger.open)
            issued = ledger.issued
            new = 0
            for tid in ids:
                index = ticket_index(tid)
                if index is None:
                    continue
                # A reissue of a ticket already closed (trained meanwhile) changes nothing;
                # one of a ticket beyond `issued` means its first issue was lost with the
                # log's tail, so the reissue opens it.
                known = index < ledger.issued
                if attempt > 0 and known and index not in opened:
                    continue
                if attempt == 0 and known:
                    continue  # a duplicate of the first issue
                new += index not in opened
                opened[index] = OpenTicket(index, n, attempt, version)
                issued = max(issued, index + 1)
            # A reissue answers the same prompt again: not a new prompt for the window.
            window = ledger.window + (new if attempt == 0 else 0)
            return msgspec.structs.replace(ledger, issued=issued, open=opened, window=window)
        case StepFinished(sample_ids=ids, param_version=version):
            ledger = _close(ledger, (ticket_of_sample(sid) for sid in ids))
            if version != ledger.version:  # a weight sync: verl's count restarts
                ledger = msgspec.structs.replace(ledger, version=version,
                                                 window=len(ledger.open))
            return ledger
        case TicketsClosed(ticket_ids=ids):
            return _close(ledger, (ticket_index(tid) for tid in ids), untrained=True)
    return ledger


def fold(events: Iterable[Message], ledger: Ledger | None = None) -> Ledger:
    """Fold events (in log order) into a :class:`Ledger`."""
    ledger = ledger or Ledger()
    for event in events:
        ledger = apply(ledger, event)
    return ledger
