"""The trainer's watch over the run: its peers, its progress, and what others report.

- Peers: the rollouters' latest heartbeats, read from their liveness keys (by Redis's clock:
  a key that exists means the replica spoke within the timeout). No rollouter alive for
  ``heartbeat.timeout_s``, or rollouts failing :data:`FAILURE_LIMIT` times in a row with no
  sample in between, is a :class:`PeerDead` failure naming what is missing. Liveness is not
  progress: each read also notes, per rollouter, when the progress counter its heartbeat
  carries last changed (:func:`observe_progress`, by the trainer's clock), so that dispatch
  can take the tickets of a live rollouter whose work is wedged (trainer.dispatch).
- Progress: without progress for ``heartbeat.stall_warn_s`` the trainer says what it waits
  for (``WarningRaised(trainer_stalled)``), and after ``heartbeat.stall_timeout_s`` fails
  saying the same: no silent wait.
- Reports: a background reader of the events log (RolloutFailed, ProfilerReady) and of the
  dead-letter stream (tickets and samples of ours that went there), whose findings the step
  loop takes in between reads of samples.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from bus import Bus, Entry, RunKeys
from bus.liveness import peers
from bus.messages import (
    DeadLetter,
    DecodeError,
    Heartbeat,
    ProfilerReady,
    PromptTicket,
    RolloutFailed,
    Sample,
    WarningRaised,
    decode,
)
from runconfig import Config
from runtime import Failure, Follower, LogFollower, since

__all__ = ["FAILURE_LIMIT", "PeerDead", "Peers", "Progress", "Watch", "observe_progress"]

FAILURE_LIMIT = 10
"""Consecutive rollout failures (with no sample in between) after which the run fails."""


class PeerDead(Failure):
    """A component the trainer depends on is gone, or the run cannot progress; the message
    names what it was waiting for."""


class Progress(NamedTuple):
    """A rollouter's progress counter as the trainer saw it: the process (``pid``), the
    counter's ``value``, and ``since``, when the trainer first saw that value (monotonic,
    the trainer's clock: no two hosts' clocks are compared)."""

    pid: int
    value: int
    since: float


class Peers(NamedTuple):
    """The rollouters alive now (their heartbeats) and their progress by consumer name
    (``RunKeys.rollouter_consumer``); a rollouter that reports no progress counter has no
    entry."""

    heartbeats: list[Heartbeat]
    progress: dict[str, Progress]


def observe_progress(seen: Mapping[str, Progress], heartbeats: Sequence[Heartbeat],
                     now: float) -> dict[str, Progress]:
    """The progress of each of these live rollouters at ``now``, after ``seen``: a counter
    that moved (or a new process) is seen since ``now``, an unchanged one keeps its
    ``since``. The counter only grows within a process, so equal values seen at two times
    mean no progress in between, however rarely the trainer looks."""
    out: dict[str, Progress] = {}
    for hb in heartbeats:
        if hb.role != "rollouter" or hb.progress is None:
            continue
        consumer = RunKeys.rollouter_consumer(hb.rank)
        before = seen.get(consumer)
        if before is not None and (before.pid, before.value) == (hb.pid, hb.progress):
            out[consumer] = before
        else:
            out[consumer] = Progress(hb.pid, hb.progress, now)
    return out


class Watch:
    """Peers, progress and reports of one run, for its trainer."""

    def __init__(self, cfg: Config, bus: Bus, keys: RunKeys) -> None:
        self.cfg = cfg
        self.bus = bus
        self.keys = keys
        self.rollouters: list[Heartbeat] = []
        self.progress: dict[str, Progress] = {}  # rollouters' progress, by consumer name
        self.rollouters_seen_at = time.monotonic()
        self.peers_read_at = 0.0
        self.last_progress = time.monotonic()
        self.last_stall_warning = 0.0
        self.rollout_failures = 0
        self.failures_since_sample = 0
        self.last_failure = ""
        self.profiler_ready = asyncio.Event()
        self.dead_tickets: list[PromptTicket] = []  # dead-lettered by rollouters: to close
        self.lost_samples: list[Sample] = []  # dead-lettered from our group: reissue them
        # The other roles' facts the trainer acts on: rollouts failing, the profiler ready.
        self.events = LogFollower(bus, keys, ("rollouter", "profiler"), fold=self._fold_events)
        self.dead = Follower(bus, keys.dlq, fold=self._fold_dead)

    # ------------------------------------------------------------------ reports

    def follow_from(self, position: str | None) -> None:
        """Reports start after ``position`` (the log the trainer folded: the past is not
        news)."""
        self.events.start_at_end(dict.fromkeys(self.events.positions, since(position)))

    async def follow(self) -> None:
        """Background, until cancelled: new events (a blocking read) and dead letters."""
        while True:
            await self.events.poll(block_ms=1000)
            await self.dead.poll()

    def _fold_events(self, entries: Sequence[Entry]) -> None:
        for _, msg in entries:
            match msg:
                case RolloutFailed():
                    self.rollout_failures += 1
                    self.failures_since_sample += 1
                    self.last_failure = f"rollouter{msg.rank}: {msg.error}"
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

    def take_dead_tickets(self) -> list[PromptTicket]:
        dead, self.dead_tickets = self.dead_tickets, []
        return dead

    def take_lost_samples(self) -> list[Sample]:
        lost, self.lost_samples = self.lost_samples, []
        return lost

    # ------------------------------------------------------------------ peers

    def samples_arrived(self) -> None:
        """Samples came in: rollouts are not all failing."""
        self.failures_since_sample = 0

    def progressed(self) -> None:
        self.last_progress = time.monotonic()

    async def read_peers(self) -> Peers:
        """The rollouters' latest heartbeats, from their liveness keys, and their progress
        (when each one's progress counter last changed)."""
        self.peers_read_at = time.monotonic()
        self.rollouters = await peers(self.bus, self.keys.alive_pattern("rollouter"))
        self.progress = observe_progress(self.progress, self.rollouters, time.monotonic())
        return Peers(self.rollouters, self.progress)

    async def fresh_peers(self) -> None:
        """Read the peers when the last read is a heartbeat interval old."""
        if time.monotonic() - self.peers_read_at >= self.cfg.heartbeat.interval_s:
            await self.read_peers()

    async def check_peers(self) -> None:
        """Raise PeerDead when no rollouter is alive (by Redis's clock: their liveness keys
        have lapsed) for the heartbeat timeout, or when rollouts keep failing."""
        if self.failures_since_sample >= FAILURE_LIMIT:
            raise PeerDead(
                f"rollouts keep failing: {self.failures_since_sample} failures and no sample "
                f"since the last one; last failure from {self.last_failure}"
            )
        now = time.monotonic()
        if now - self.peers_read_at < self.cfg.heartbeat.interval_s:
            return
        await self.read_peers()
        if self.rollouters:
            self.rollouters_seen_at = now
            return
        timeout = self.cfg.heartbeat.timeout_s
        gone_for = now - self.rollouters_seen_at
        if gone_for >= timeout:
            raise PeerDead(
                f"no rollouter is alive: none has refreshed its liveness key "
                f"{self.keys.alive_pattern('rollouter')} for {gone_for:.0f} s "
                f"(heartbeat.timeout_s={timeout}); is a rollouter running for run "
                f"{self.keys.run_id!r} at this Redis?"
            )

    def rollouters_state(self) -> str:
        return ", ".join(f"rollouter{h.rank} ({h.state})" for h in self.rollouters) or "none"

    def idle_ratio(self) -> float:
        """The rollouters' mean idle share, from their latest pulses (NaN: none known)."""
        idle = [hb.metrics["rollouter/idle_ratio"] for hb in self.rollouters
                if "rollouter/idle_ratio" in hb.metrics]
        return sum(idle) / len(idle) if idle else float("nan")

    def weights_sync(self) -> dict[str, float]:
        """The slowest rollouter's last weights load, from their latest pulses: seconds
        copying into its engine (``rollouter/weights_load_s``) and from the publication to
        the engine holding it (``rollouter/weights_sync_s``); absent until one loaded."""
        out: dict[str, float] = {}
        for key in ("rollouter/weights_load_s", "rollouter/weights_sync_s"):
            seen = [hb.metrics[key] for hb in self.rollouters if key in hb.metrics]
            if seen:
                out[key] = max(seen)
        return out

    # ------------------------------------------------------------------ progress

    async def check_stall(self, waiting_for: Callable[[], str]) -> WarningRaised | None:
        """Raise PeerDead after ``stall_timeout_s`` without progress; a warning to publish
        (printed here) every ``stall_warn_s`` before that."""
        hb = self.cfg.heartbeat
        now = time.monotonic()
        stalled = now - self.last_progress
        if stalled >= hb.stall_timeout_s:
            raise PeerDead(f"no progress for {stalled:.0f} s (heartbeat.stall_timeout_s="
                           f"{hb.stall_timeout_s}): {waiting_for()}")
        if stalled < hb.stall_warn_s or now - self.last_stall_warning < hb.stall_warn_s:
            return None
        self.last_stall_warning = now
        message = f"no progress for {stalled:.0f} s: {waiting_for()}"
        print(f"trainer: warning: {message}", file=sys.stderr, flush=True)
        return WarningRaised(source="trainer", code="trainer_stalled", message=message)

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
