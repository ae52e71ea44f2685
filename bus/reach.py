"""Two clocks a client keeps beside the loop's: time this process ran, time Redis answered.

A call that waited 60 s may have waited on Redis (stopped, restarting, failing over) or on
this process (SIGSTOP, a frozen VM, a loop blocked by a long collection). The two need
opposite answers: Redis's silence is waited out up to ``redis.give_up_s`` and then named; a
process that did not run has nothing to blame on Redis, and must re-check what it holds
(its lease, its rank) before going on, since its peers may have judged it gone meanwhile.

- :class:`Stalls` tells the second case apart: the client's watchdog timer is due every tick
  while calls are in flight; one that comes (or is still due) ``pause_s`` or more late means
  the loop did not run for that long. The retry budget and the silence lines count time
  without it (:meth:`Stalls.clock`), so a pause is never "Redis did not answer".
- :class:`Reach` is the clock peers are judged by: it stops while this client hears nothing
  from Redis (past a grace), so a liveness key that lapsed during an outage, when nobody
  could write, is not taken for a dead peer. Judgements of "absent for T s" made on it count
  only time in which the peer could have spoken.

Both are pure: times come in as arguments (the loop's clock), so the decisions are tested
without a server.

>>> s = Stalls(pause_s=5.0)
>>> s.armed(due=10.0)
>>> s.pending(now=12.0), s.pending(now=70.0)  # 2 s late: a busy loop; 60 s: a pause
(0.0, 60.0)
>>> s.fired(now=70.0), s.clock(now=71.0)
(60.0, 11.0)
>>> r = Reach(grace_s=5.0)
>>> r.ended(now=1.0, oldest=0.0, answered=True)      # a normal call
0.0
>>> r.clock(now=50.0, oldest=2.0)                     # silent since 2 s: stopped at 7 s
7.0
>>> r.ended(now=92.0, oldest=2.0, answered=True)     # Redis answers again: 85 s dark
85.0
>>> r.clock(now=93.0, oldest=None)
8.0
"""

from __future__ import annotations

import math

__all__ = ["PAUSE_S", "REACH_GRACE_S", "Reach", "Stalls"]

PAUSE_S = 5.0
"""A watchdog tick this late means this process did not run (a pause), not a busy loop."""

REACH_GRACE_S = 5.0
"""Silence shorter than this is a slow reply, not an outage: the reach clock runs on."""


class Stalls:
    """The time this process did not run, from a watchdog timer's lateness.

    ``armed(due)`` when the timer is scheduled (loop time ``due``), ``fired(now)`` when it
    runs, ``disarmed()`` when it stops (no call in flight: nothing to time). A tick at least
    ``pause_s`` late counts whole: the loop did not run from ``due`` to ``now``."""

    def __init__(self, pause_s: float = PAUSE_S) -> None:
        if pause_s <= 0:
            raise ValueError(f"pause_s must be > 0, got {pause_s}")
        self.pause_s = pause_s
        self.paused_s = 0.0
        """Seconds this process did not run, over the pauses counted so far."""
        self.due: float | None = None

    def armed(self, due: float) -> None:
        self.due = due

    def disarmed(self) -> None:
        self.due = None

    def pending(self, now: float) -> float:
        """The pause not yet counted: the tick is ``pause_s`` or more overdue at ``now`` (the
        loop is running again, and the timer has not run yet); else 0."""
        if self.due is None:
            return 0.0
        late = now - self.due
        return late if late >= self.pause_s else 0.0

    def fired(self, now: float) -> float:
        """The tick ran at ``now``: the pause it ends (0: none), counted."""
        late = self.pending(now)
        self.paused_s += late
        self.due = None
        return late

    def clock(self, now: float) -> float:
        """``now`` less every pause, the pending one included: time this process ran."""
        return now - self.paused_s - self.pending(now)


class Reach:
    """A clock that stops while a client hears nothing from Redis.

    Times are a :meth:`Stalls.clock` (this process's own pauses are not Redis's silence).
    ``oldest`` is when the longest-waiting call in flight began to wait for its answer
    (after its block time), None when no call is in flight. Darkness is the time since the
    later of that and the last answer, past ``grace_s``; it is counted into :attr:`dark_s`
    when a call ends (:meth:`ended`), so the clock runs on from where it stopped."""

    def __init__(self, grace_s: float = REACH_GRACE_S) -> None:
        self.grace_s = grace_s
        self.dark_s = 0.0
        """Seconds Redis was dark, over the outages ended so far."""
        self.heard_at = -math.inf
        self.lit_at = -math.inf
        """When the last outage ended (a call ended after darkness was counted)."""
        self._counted_to = -math.inf

    def dark_now(self, now: float, oldest: float | None) -> float:
        """Seconds of the outage going on at ``now`` not yet counted (0: none)."""
        if oldest is None:
            return 0.0
        start = max(self.heard_at, oldest) + self.grace_s
        return max(0.0, now - max(start, self._counted_to))

    def ended(self, now: float, oldest: float | None, answered: bool) -> float:
        """A call ended at ``now`` (``oldest``: as it was with the call still in flight),
        ``answered`` or not: the darkness up to now, counted; returned."""
        dark = self.dark_now(now, oldest)
        self.dark_s += dark
        if dark > 0:
            self.lit_at = now
        self._counted_to = max(self._counted_to, now)
        if answered:
            self.heard_at = now
        return dark

    def clock(self, now: float, oldest: float | None) -> float:
        """``now`` less every second Redis was dark: non-decreasing while calls come and go."""
        return now - self.dark_s - self.dark_now(now, oldest)

    def since_dark_s(self, now: float, oldest: float | None) -> float:
        """Seconds since the last outage ended (0 during one; inf: none yet)."""
        if self.dark_now(now, oldest) > 0:
            return 0.0
        return now - self.lit_at

