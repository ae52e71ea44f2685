"""The run's health as the trainer judges it: its peers, their progress, its own progress.

Pure: the heartbeats and reports come in as values read by the shell (trainer.watch), the
time as an argument.

- Peers: the rollouters' latest heartbeats, read from their liveness keys (a key that
  exists means the replica spoke within the timeout, by Redis's clock). No rollouter alive
  for ``heartbeat.timeout_s``, or rollouts failing :data:`FAILURE_LIMIT` times in a row
  with no sample in between, is a :class:`PeerDead` failure naming what is missing.
  Liveness is not progress: each read also notes, per rollouter, when the progress counter
  its heartbeat carries last changed (:func:`observe_progress`, by the trainer's clock), so
  that dispatch can take the tickets of a live rollouter whose work is wedged
  (trainer.dispatch).
- Progress: without progress for ``heartbeat.stall_warn_s`` the trainer says what it waits
  for (``WarningRaised(trainer_stalled)``), and after ``heartbeat.stall_timeout_s`` fails
  saying the same: no silent wait.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from bus import RunKeys
from runconfig import HeartbeatConfig
from runschema.messages import ComponentFailed, Heartbeat, RolloutFailed, WarningRaised
from runtime import Failure

__all__ = ["FAILURE_LIMIT", "Health", "PeerDead", "Progress", "observe_progress"]

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


class Health:
    """Peers, failures and progress of one run, for its trainer; ``now``: when the trainer
    starts judging (its rollouters have a heartbeat timeout from then on)."""

    def __init__(self, hb: HeartbeatConfig, keys: RunKeys, now: float) -> None:
        self.hb = hb
        self.keys = keys
        self.rollouters: list[Heartbeat] = []
        self.progress: dict[str, Progress] = {}  # rollouters' progress, by consumer name
        self.seen_at = now  # when a rollouter was last seen alive
        self.read_at = -math.inf  # when the peers were last read
        self.last_progress = now
        self.last_stall_warning = -math.inf
        self.rollout_failures = 0
        self.failures_since_sample = 0
        self.last_failure = ""
        self.stated: dict[int, str] = {}
        """Each rollouter rank's last stated failure (its ComponentFailed), until it is seen
        alive again: what a "no rollouter is alive" repeats (one per rank: bounded)."""

    # ------------------------------------------------------------------ reports

    def failed(self, failures: Sequence[RolloutFailed]) -> None:
        for msg in failures:
            self.rollout_failures += 1
            self.failures_since_sample += 1
            self.last_failure = f"rollouter{msg.rank}: {msg.error}"

    def peers_failed(self, failures: Sequence[ComponentFailed]) -> None:
        """Rollouters that said why they went (their ComponentFailed events)."""
        for msg in failures:
            if msg.role == "rollouter":
                self.stated[msg.rank] = msg.error

    def samples_arrived(self) -> None:
        """Samples came in: rollouts are not all failing."""
        self.failures_since_sample = 0

    def progressed(self, now: float) -> None:
        self.last_progress = max(self.last_progress, now)

    # ------------------------------------------------------------------ peers

    def peers_due(self, now: float) -> bool:
        """Whether the peers' last read is a heartbeat interval old."""
        return now - self.read_at >= self.hb.interval_s

    def observe(self, heartbeats: Sequence[Heartbeat], now: float) -> None:
        """The rollouters alive at ``now`` (their heartbeats), and their progress."""
        self.read_at = now
        self.rollouters = list(heartbeats)
        self.progress = observe_progress(self.progress, self.rollouters, now)
        for hb in self.rollouters:  # alive again: what it said when it went is history
            self.stated.pop(hb.rank, None)

    def alive(self) -> set[str]:
        """The consumer names of the rollouters alive at the last read."""
        return {RunKeys.rollouter_consumer(hb.rank) for hb in self.rollouters}

    def check_failures(self) -> None:
        """Raise PeerDead when rollouts keep failing."""
        if self.failures_since_sample >= FAILURE_LIMIT:
            raise PeerDead(
                f"rollouts keep failing: {self.failures_since_sample} failures and no sample "
                f"since the last one; last failure from {self.last_failure}"
            )

    def check_peers(self, now: float) -> None:
        """After a read of the peers at ``now``: raise PeerDead when no rollouter is alive
        (by Redis's clock: their liveness keys have lapsed) for the heartbeat timeout. What
        the rollouters stated when they went (Redis out of memory, a full disk) is repeated
        in it, rather than a bare "none has refreshed its liveness key"."""
        if self.rollouters:
            self.seen_at = now
            return
        gone_for = now - self.seen_at
        if gone_for < self.hb.timeout_s:
            return
        line = (f"no rollouter is alive: none has refreshed its liveness key "
                f"{self.keys.alive_pattern('rollouter')} for {gone_for:.0f} s "
                f"(heartbeat.timeout_s={self.hb.timeout_s})")
        if self.stated:
            said = "; ".join(f"rollouter{rank} failed: {error}"
                             for rank, error in sorted(self.stated.items()))
            raise PeerDead(f"{line}; {said}")
        raise PeerDead(f"{line}; is a rollouter running for run {self.keys.run_id!r} at "
                       "this Redis?")

    def rollouters_state(self) -> str:
        return ", ".join(f"rollouter{h.rank} ({h.state})" for h in self.rollouters) or "none"

    def idle_ratio(self) -> float:
        """The rollouters' mean idle share, from their latest pulses (NaN: none known)."""
        idle = [hb.metrics["rollouter/idle_ratio"] for hb in self.rollouters
                if "rollouter/idle_ratio" in hb.metrics]
        return sum(idle) / len(idle) if idle else float("nan")

    def rollout_shares(self) -> dict[str, float]:
        """What the rollouters' loops did, from their latest pulses: per lap
        (``rollouter/timing_s/<lap>``, rollouter.context), its share of the pulse's window,
        the mean over the rollouters (``rollouter/timing_share/<lap>``); absent until one
        reported a window."""
        prefix, window = "rollouter/timing_s/", "rollouter/timing_s/window"
        shares: dict[str, list[float]] = {}
        for hb in self.rollouters:
            total = hb.metrics.get(window, 0.0)
            if total <= 0:
                continue
            for key, seconds in hb.metrics.items():
                if key.startswith(prefix) and key != window:
                    shares.setdefault(key[len(prefix):], []).append(seconds / total)
        return {f"rollouter/timing_share/{lap}": sum(v) / len(v) for lap, v in shares.items()}

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

    def check_stall(self, now: float, waiting_for: Callable[[], str]) -> WarningRaised | None:
        """Raise PeerDead after ``stall_timeout_s`` without progress; a warning to say and
        publish every ``stall_warn_s`` before that."""
        stalled = now - self.last_progress
        if stalled >= self.hb.stall_timeout_s:
            raise PeerDead(f"no progress for {stalled:.0f} s (heartbeat.stall_timeout_s="
                           f"{self.hb.stall_timeout_s}): {waiting_for()}")
        if stalled < self.hb.stall_warn_s or now - self.last_stall_warning < self.hb.stall_warn_s:
            return None
        self.last_stall_warning = now
        return WarningRaised(source="trainer", code="trainer_stalled",
                             message=f"no progress for {stalled:.0f} s: {waiting_for()}")
