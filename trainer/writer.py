"""The trainer's fenced writer: the only way the trainer writes to the bus.

Every write is one Lua script that checks the run's fencing lease (:class:`bus.Lease`), so a
second trainer, or a paused zombie of this one, writes nothing; and it is accepted only while
this trainer's last StepFinished is still in the log, so a trainer that has not yet noticed
that Redis lost its tail (AOF ``everysec``) writes nothing into the log that replaced it
(:class:`LogBehind`: start over from the log as it is).

The writer also holds what the trainer knows of the log: ``state = fold(events)``
(:mod:`trainer.state`), folded from the log at start (from the newest snapshot the log
confirms, :func:`trainer.resume.read_log`) and then from every event it writes, with the
position of the last one (what a checkpoint's snapshot records).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from bus import Bus, EntryGone, Fenced, Lease, RetryHook, RunKeys
from runschema.messages import Event, Message, StepFinished
from runtime import Restart
from trainer.actions import IssueTickets
from trainer.resume import LogRead, Refused, Snapshot, read_log
from trainer.state import TrainerState, take

__all__ = ["LogBehind", "Writer"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class LogBehind(Restart):
    """The events log lost writes this trainer made (Redis restarted without its last
    second): the trainer must resume from the log as it is now."""


class Writer:
    """Writes of one trainer incarnation, fenced by ``lease``; its folded view of the log."""

    def __init__(self, bus: Bus, keys: RunKeys, lease: Lease) -> None:
        self.bus = bus
        self.keys = keys
        self.lease = lease
        self.state = TrainerState()
        self.position: str | None = None
        """Id of the last events entry in :attr:`state` (read or written)."""
        self.last_finished_id: str | None = None
        """Id of this trainer's last StepFinished: every write requires it to be there."""
        self.entries_read = 0
        self.refused: list[Refused] = []
        """Events of the log the fold refused at start (trainer.state.refusal)."""
        self.skipped_snapshots: list[str] = []
        """Why each corrupt snapshot the fold passed over was (trainer.resume.read_log)."""
        self.fenced: str | None = None
        """The holder that took the lease from us (set by a write or a pulse)."""
        self.floor: Callable[[], str | None] = lambda: None
        """The newest entry id the trainer has read from the other roles' streams: every
        write comes after it in the merged log (bus.Lease.write)."""

    async def read_log(self, checkpoints: Path, archive: Path | None = None) -> LogRead:
        """Fold the log (from the newest snapshot the log confirms) into :attr:`state`;
        ``archive``: the run's archived events (trainer.resume.read_log). Returns the read
        (what the log holds beyond the fold: trainer.resume.not_covered)."""
        read = await read_log(self.bus, self.keys, checkpoints, archive)
        self.state, self.position = read.state, read.position
        self.last_finished_id, self.entries_read = read.last_finished_id, read.entries_read
        self.refused = read.refused
        self.skipped_snapshots = read.skipped_snapshots
        return read

    async def write(
        self, items: Sequence[tuple[str, Message]],
        ack: tuple[str, str, Sequence[str]] | None = None,
    ) -> list[str]:
        """Append ``(stream, msg)`` items (and XACK ``ack``) in one fenced script, only while
        our last StepFinished is still in the log (see the module docstring)."""
        ids = await self._checked(
            lambda require: self.lease.write(items, ack, require, floor=self.floor()))
        for (stream, _), entry_id in zip(items, ids, strict=True):
            if stream == self.keys.events:
                self.position = entry_id  # the snapshot's position in the log
        return ids

    async def run_fenced(
        self, body: str, keys: Sequence[str], args: Sequence[Any], *, op: str = "EVAL",
        on_retry: RetryHook | None = None,
    ) -> Any:
        """The Lua ``body`` behind the same checks as :meth:`write` (the trainer's
        consumer-group calls: its samples :class:`bus.Consumer` takes this writer as its
        ``fence``). See :meth:`bus.Lease.run_fenced`."""
        return await self._checked(lambda require: self.lease.run_fenced(
            body, keys, args, require=require, op=op, on_retry=on_retry))

    async def _checked(self, call: Callable[[tuple[str, str] | None], Awaitable[T]]) -> T:
        """``call(require)``, a fenced script that also requires our last StepFinished;
        its refusals become :class:`LogBehind` (the log lost our writes) or
        :class:`bus.Fenced` (another trainer holds the lease; :attr:`fenced` names it)."""
        require = None if self.last_finished_id is None else (self.keys.events,
                                                             self.last_finished_id)
        try:
            return await call(require)
        except EntryGone as exc:
            raise LogBehind(f"StepFinished({self.state.last_step}) is gone from the log "
                            f"({exc})") from exc
        except Fenced as exc:
            await self.judge_refusal(exc)
            raise

    async def judge_refusal(self, exc: Fenced) -> None:
        """A fenced write was refused: raise :class:`LogBehind` when the lease is ours
        again, else record who holds it (:attr:`fenced`) and return.

        Our lease vanished (Redis restarted, maybe without its last writes) or lapsed while
        Redis was silent; it may even hold our token again by the time the refusal read the
        holder (our own pulse re-took it between the script and the GET). Then it is ours
        (taken now, or already), but the state must come from the log as it is now."""
        if exc.holder in (None, self.lease.token) and \
                await self.lease.acquire() in (None, self.lease.token):
            raise LogBehind(f"the lease {self.keys.trainer_lease} had lapsed or vanished "
                            "and is ours again") from exc
        self.fenced = exc.holder or "nobody (the lease lapsed)"

    def fold(self, *events: Event) -> None:
        """Fold events this trainer wrote into :attr:`state`."""
        for event in events:
            self._fold(event)

    def _fold(self, event: Event) -> None:
        self.state, why = take(self.state, event)
        if why is not None:  # a bug of the trainer's: a resume would refuse it too
            log.error("the trainer's own %s contradicts its state: %s", type(event).__name__,
                      why)

    async def publish(self, *events: Event) -> list[str]:
        """Write events to the run's log and fold them into :attr:`state`."""
        if not events:
            return []
        ids = await self.write([(self.keys.events, e) for e in events])
        self.fold(*events)
        return ids

    async def issue(self, issued: IssueTickets) -> list[str]:
        """Prompt tickets with the TicketsIssued that records them, in one fenced script,
        folded; the tickets' entry ids."""
        ids = await self.write([*((self.keys.prompts, t) for t in issued.tickets),
                                (self.keys.events, issued.event)])
        self.fold(issued.event)
        return ids[:len(issued.tickets)]

    async def finish_step(self, finished: StepFinished, group: str) -> None:
        """StepFinished with the acks of the samples it trained, in the same fenced script:
        an ack never lands without the event that justifies it."""
        ids = await self.write([(self.keys.events, finished)],
                               ack=(self.keys.samples, group, finished.entry_ids))
        self._fold(finished)
        self.last_finished_id = self.position = ids[0]

    async def renew(self) -> None:
        """At every pulse (never blocked by a step): renew the lease; take it back if Redis
        lost it; note a holder that is not us (fenced)."""
        if not await self.lease.renew():
            holder = await self.lease.holder()
            if holder is None:
                # The key vanished (Redis restarted): ours again. The log may have lost
                # its tail too: every write checks our last StepFinished (write).
                await self.lease.acquire()
            elif holder != self.lease.token:
                self.fenced = holder

    def check_fenced(self) -> None:
        """Raise :class:`bus.Fenced` once another trainer holds the lease."""
        if self.fenced is not None:
            raise Fenced(self.keys.trainer_lease, self.lease.token, self.fenced)

    def snapshot(self) -> bytes:
        """The state and its position, for the checkpoint's side file."""
        return msgspec.msgpack.encode(Snapshot(self.state, self.position or "0-0",
                                               self.last_finished_id))
