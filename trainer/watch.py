"""What the trainer reads of the run besides samples: its peers, the holders of its tickets,
and what others report.

The shell's reader for the step core (trainer.core), which judges what is read here
(trainer.health, trainer.dispatch):

- Peers: the rollouters' latest heartbeats, read from their liveness keys (by Redis's clock:
  a key that exists means the replica spoke within the timeout).
- Holders: of the prompts entries of tickets whose lease expired, those still in the stream
  and the rollouter each pending one is delivered to.
- Reports: a background reader of the events log (RolloutFailed, the rollouters'
  ComponentFailed, ProfilerReady) and of the
  dead-letter stream (tickets and samples of ours that went there), whose findings the step
  loop takes in between reads of samples.
- Claims: the rollouters' TicketsClaimed, read by the step loop itself with each read of
  samples that delivers some (in the read's script: :meth:`bus.Consumer.read_then`; not in
  the background), so a claim is always read before the answers that follow it
  (trainer.claims).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from bus import Bus, Entry, RunKeys, Then, ThenRead, peers
from runconfig import Config
from runschema.messages import (
    ComponentFailed,
    DeadLetter,
    DecodeError,
    Heartbeat,
    ProfilerReady,
    PromptTicket,
    RolloutFailed,
    Sample,
    TicketsClaimed,
    decode,
)
from runtime import Follower, LogFollower, since
from trainer.actions import Due, Holders
from trainer.dispatch import ROLLOUTER_GROUP

__all__ = ["REPORTS_GATHER_S", "Watch"]

REPORTS_GATHER_S = 0.05
"""After a read of reports that found something, the background reader waits this long before
the next: the rollouters write a few entries a step (their claims), and a wake-up for each
costs two round trips (the log, then the dead letters) of the trainer's event loop, on the
update's core. A report (a failed rollout, a dead ticket) is at most this much later, far
below anything it is judged by (heartbeat.timeout_s, a ticket's lease)."""


class Watch:
    """Peers, ticket holders and reports of one run, read for its trainer."""

    def __init__(self, cfg: Config, bus: Bus, keys: RunKeys) -> None:
        self.cfg = cfg
        self.bus = bus
        self.keys = keys
        self.profiler_ready = asyncio.Event()
        self.failures: list[RolloutFailed] = []  # rollouts that failed: to count
        self.peer_failed: list[ComponentFailed] = []  # rollouters that said why they went
        self.dead_tickets: list[PromptTicket] = []  # dead-lettered by rollouters: to close
        self.lost_samples: list[Sample] = []  # dead-lettered from our group: reissue them
        # The other roles' facts the trainer acts on: rollouts failing, the profiler ready.
        self.events = LogFollower(bus, keys, ("rollouter", "profiler"), fold=self._fold_events)
        self.dead = Follower(bus, keys.dlq, fold=self._fold_dead)
        # Its own reader of the rollouters' stream: the background one's reads may lag.
        self.claims = Follower(bus, keys.log("rollouter"))

    # ------------------------------------------------------------------ reports

    def follow_from(self, position: str | None) -> None:
        """Reports start after ``position`` (the log the trainer folded: the past is not
        news)."""
        self.events.start_at_end(dict.fromkeys(self.events.positions, since(position)))
        # Tickets this incarnation issues come after it: so do all claims it judges by.
        self.claims.position = since(position)

    def claims_then(self) -> Then:
        """The claims' next read, to be made right after a read of samples delivers some
        (:meth:`bus.Consumer.read_then`): one round trip for both."""
        return Then(self.claims.stream, self.claims.position, self.claims.count)

    async def read_claims(self, read: ThenRead | None = None) -> list[TicketsClaimed]:
        """The rollouters' claims stated since the last call (to the end of their stream:
        every claim an answer already read follows), starting from ``read``, the
        :meth:`claims_then` read made with the samples, when there is one. Wraps XREAD
        (non-blocking) for the rest."""
        entries = [] if read is None else self.claims.took(*read)
        if read is None or not self.claims.caught_up:
            entries += await self.claims.poll()
            while not self.claims.caught_up:
                entries += await self.claims.poll()
        return [msg for _, msg in entries if isinstance(msg, TicketsClaimed)]

    async def follow(self) -> None:
        """Background, until cancelled: new events (a blocking read) and dead letters."""
        while True:
            found = await self.events.poll(block_ms=1000)
            # To its end each turn, not a batch a second: under a flood of refused junk a
            # rollouter's dead ticket is seen at once, before the capped stream drops it.
            await self.dead.poll()
            while not self.dead.caught_up:
                await self.dead.poll()
            if found:  # what comes next gathers meanwhile: one wake-up, not one an entry
                await asyncio.sleep(REPORTS_GATHER_S)

    def _fold_events(self, entries: Sequence[Entry]) -> None:
        for _, msg in entries:
            match msg:
                case RolloutFailed():
                    self.failures.append(msg)
                case ComponentFailed(role="rollouter"):
                    self.peer_failed.append(msg)
                case ProfilerReady():
                    self.profiler_ready.set()

    def _fold_dead(self, entries: Sequence[Entry]) -> None:
        for _, letter in entries:
            if not isinstance(letter, DeadLetter):
                continue
            # Only a decodable ticket or sample of ours touches the ledger: garbage that
            # went to the DLQ never frees (or takes) a budget slot.
            try:
                original = decode(letter.raw)
            except DecodeError:
                continue
            if letter.source_stream == self.keys.prompts and isinstance(original, PromptTicket):
                self.dead_tickets.append(original)
            elif letter.source_stream == self.keys.samples and isinstance(original, Sample):
                self.lost_samples.append(original)

    def take_failures(self) -> list[RolloutFailed]:
        failures, self.failures = self.failures, []
        return failures

    def take_peer_failed(self) -> list[ComponentFailed]:
        """The rollouters' ComponentFailed events read since the last call."""
        failed, self.peer_failed = self.peer_failed, []
        return failed

    def take_dead_tickets(self) -> list[PromptTicket]:
        dead, self.dead_tickets = self.dead_tickets, []
        return dead

    def take_lost_samples(self) -> list[Sample]:
        lost, self.lost_samples = self.lost_samples, []
        return lost

    # ------------------------------------------------------------------ peers, holders

    async def read_peers(self) -> list[Heartbeat]:
        """The rollouters' latest heartbeats, from their liveness keys."""
        return await peers(self.bus, self.keys.alive_pattern("rollouter"))

    async def holders(self, due: Due) -> Holders:
        """Who holds the expired tickets ``due`` names (trainer.dispatch.Dispatch.lost):
        their prompts entries still in the stream, and the owners of the entries pending
        in the rollouters' group."""
        if not due.entries:
            return Holders(due.expired)
        present = await self.bus.read_ids(self.keys.prompts, due.entries)
        owners = await self.bus.pending_owners(self.keys.prompts, ROLLOUTER_GROUP, due.owners)
        return Holders(due.expired, set(present), owners)

    async def wait_for_profiler(self, bound_s: float, check_fenced: Callable[[], None]) -> bool:
        """Wait for ProfilerReady (bounded), in slices: a trainer fenced out meanwhile
        (paused past its lease) stops at once. Whether it came."""
        deadline = time.monotonic() + bound_s
        while not self.profiler_ready.is_set():
            check_fenced()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.profiler_ready.wait(),
                                       min(left, self.cfg.heartbeat.interval_s))
            except TimeoutError:
                continue
        return True
