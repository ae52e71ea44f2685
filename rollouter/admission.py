"""Continuous admission's bookkeeping, pure (no engine, no bus): the tickets whose responses
a streaming engine is generating (:class:`Admission`), and when the engine must be emptied
(:func:`sync_action`).

A ticket's ``n`` responses are streamed under the keys ``"{ticket_id}#{attempt}/{index}"``
(:func:`stream_key`); the engine
reports what each generated (:class:`rollouter.engine.Delta`) with the weights version it
held, and a ticket is done once all its responses have ended.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import msgspec

from bus import Delivery
from rollouter.answers import Seq
from rollouter.engine import Delta
from runschema.messages import PromptTicket

__all__ = ["Action", "Admission", "Group", "stream_key", "sync_action"]


class Group(msgspec.Struct):
    """One ticket being generated: its delivery (to ack or retry), its prompt's token ids,
    its responses, when it was admitted and when its last response ended (``time.time``;
    0 until then)."""

    delivery: Delivery
    ticket: PromptTicket
    prompt: list[int]
    seqs: list[Seq]
    began: float
    ended: float = 0.0

    @property
    def ticket_id(self) -> str:
        return self.ticket.ticket_id


def stream_key(ticket: PromptTicket, index: int, turn: int = 0) -> str:
    """The engine's key of response ``index`` of ``ticket``: ``tN#A/i`` for attempt ``A``, so
    that a reissue of a ticket whose older attempt still runs never reuses a running key;
    ``tN#A/i~T`` for turn ``T`` > 0 of a conversation (each turn is a request of its own)."""
    key = f"{ticket.ticket_id}#{ticket.attempt}/{index}"
    return f"{key}~{turn}" if turn else key


class Admission:
    """The tickets admitted to the engine and not yet done. ``max_new_tokens``: a response
    that reaches it has ended (rollout.max_new_tokens)."""

    def __init__(self, max_new_tokens: int) -> None:
        self.max_new_tokens = max_new_tokens
        self.groups: dict[str, Group] = {}
        self.running: dict[str, Seq] = {}  # responses not yet ended, by stream key
        self._group_of: dict[str, str] = {}  # stream key -> ticket id
        self.superseded: list[Group] = []
        """Groups replaced by a newer attempt of their ticket, their entries to ack."""
        self.cancelled: list[str] = []
        """Stream keys of those groups' responses still running: to end in the engine."""
        self.turned: list[tuple[str, Seq]] = []
        """Conversations whose assistant turn ended (ticket id, response): the loop decides
        whether each goes on (its tools run meanwhile, outside the engine)."""

    @property
    def seqs(self) -> int:
        """Responses admitted and not yet ended."""
        return len(self.running)

    def open(self, delivery: Delivery, ticket: PromptTicket, prompt: list[int],
             now: float) -> list[tuple[str, Seq]]:
        """Admit ``ticket``: its ``n`` responses, each with the key to stream it under (its
        attempt in it). A newer attempt of a ticket admitted already (reissued by the trainer
        and claimed by this same rollouter) replaces it: the older group is dropped, what the
        engine still reports for it ignored, its responses still running listed in
        :attr:`cancelled` (the loop ends them in the engine, freeing their slots and KV
        blocks), and it waits in :attr:`superseded` for its ack (the trainer takes the first
        whole answer of any attempt)."""
        older = self.groups.get(ticket.ticket_id)
        if older is not None and older.ticket.attempt < ticket.attempt:
            self.cancelled += self._keys_of(ticket.ticket_id)
            self.superseded += self.drop([ticket.ticket_id])
        group = Group(delivery, ticket, prompt,
                      [Seq(ticket, i, prompt, [], []) for i in range(ticket.n)], now)
        self.groups[ticket.ticket_id] = group
        keyed = [(stream_key(ticket, s.index), s) for s in group.seqs]
        for key, seq in keyed:
            self.running[key] = seq
            self._group_of[key] = ticket.ticket_id
        return keyed

    def apply(self, deltas: Iterable[Delta], version: int, now: float) -> list[Group]:
        """Fold what the engine generated with weights ``version`` into the responses; the
        tickets now done (every response ended), in the order they ended, ended at ``now``.
        A delta for a key no longer running (a dropped ticket's) is ignored."""
        done: list[Group] = []
        for d in deltas:
            seq = self.running.get(d.key)
            if seq is None:
                continue
            seq.tokens.extend(d.tokens)
            seq.logprobs.extend(d.logprobs)
            if d.tokens:
                # The version the engine says it generated with, not the one asked of it.
                seq.min_version = version if seq.min_version < 0 else seq.min_version
                seq.max_version = version
            seq.finished = d.finished or len(seq.tokens) >= self.max_new_tokens
            if seq.finished:
                del self.running[d.key]
                tid = self._group_of.pop(d.key)
                if seq.dialogue is not None and not seq.dialogue.over:
                    self.turned.append((tid, seq))  # its conversation says what follows
                    continue
                ended = self.conclude(tid, now)
                if ended is not None:
                    done.append(ended)
        return done

    def conclude(self, ticket_id: str, now: float) -> Group | None:
        """The ticket's group, taken out as done at ``now``, once every response has ended
        (a conversation's: its last turn); None while one has not."""
        group = self.groups.get(ticket_id)
        if group is None or not all(
                s.finished and (s.dialogue is None or s.dialogue.over) for s in group.seqs):
            return None
        group.ended = now
        return self.groups.pop(ticket_id)

    def holds(self, ticket_id: str, seq: Seq) -> bool:
        """Whether ``seq`` is still a response of an admitted ticket (not dropped, nor
        replaced by a newer attempt) — what a conversation's tool turn checks on return."""
        group = self.groups.get(ticket_id)
        return group is not None and any(s is seq for s in group.seqs)

    def rejoin(self, ticket_id: str, seq: Seq) -> tuple[str, Seq]:
        """A conversation's next turn: ``seq`` running again under its turn's key."""
        turn = seq.dialogue.assistant_turns if seq.dialogue is not None else 0
        key = stream_key(seq.ticket, seq.index, turn)
        self.running[key] = seq
        self._group_of[key] = ticket_id
        return key, seq

    def resumable(self) -> list[tuple[str, Seq]]:
        """Every response not yet ended, with its key: after an abort each is submitted
        again, its tokens so far appended to its prompt."""
        return list(self.running.items())

    def drop(self, ticket_ids: Iterable[str]) -> list[Group]:
        """Stop tracking these tickets (failed ones); their groups."""
        dropped = [self.groups.pop(t) for t in ticket_ids if t in self.groups]
        for group in dropped:
            for key in self._keys_of(group.ticket_id):
                self.running.pop(key, None)
                self._group_of.pop(key, None)
        return dropped

    def _keys_of(self, ticket_id: str) -> list[str]:
        """The stream keys running for ``ticket_id`` (any attempt, any turn)."""
        return [k for k, t in self._group_of.items() if t == ticket_id]


class Action(enum.Enum):
    """What the rollouter does with its engine before the next slice of generation."""

    GO = "go"  # admit tickets and generate
    DRAIN = "drain"  # admit nothing; let the responses running end
    ABORT = "abort"  # abort the responses running (resumed after the sync)
    SYNC = "sync"  # the engine is empty: load weights, serve validations, then go on


def sync_action(in_flight: int, *, partial: bool, newer_ready: bool, must_sync: bool,
                validations: bool) -> Action:
    """The engine is emptied when newer weights are fetched and ready to load
    (``newer_ready``), when tickets waiting to be admitted need newer weights than it holds
    (``must_sync``) or when validation requests wait (they run on an empty engine). With
    partial rollout (verl's ``partial_rollout``) the running responses are aborted and
    resumed with the new weights from their tokens so far; without, they end on the weights
    they started with, and nothing new is admitted meanwhile."""
    if not (newer_ready or must_sync or validations):
        return Action.GO
    if in_flight == 0:
        return Action.SYNC
    return Action.ABORT if partial else Action.DRAIN
