"""Refused entries, counted: what a consumer says about the entries it dead-letters.

A flood of junk (thousands of entries a second) must not become thousands of log lines, so a
consumer says nothing per entry: it tallies its refusals by kind (:class:`RefusalTally`) and
says one line per interval, with the counts, one example of each kind, and how many older
dead letters the capped dead-letter stream dropped. The first refusal after a quiet interval
is said at once (one bad entry is still seen when it happens). Pure: the clock comes in.

    ``Refusal(entry, reason, kind="")``   one entry to dead-letter (``kind``: what it is
                                          counted as; default the reason up to its first ':')
    ``RefusalTally(stream, group, interval_s)``
        ``.add(refusals, dropped)``        count a batch dead-lettered (and dropped letters)
        ``.line(now) -> str | None``       the line to say now, if one is due (then reset)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from bus.groups import Delivery

__all__ = ["REFUSAL_LOG_S", "Refusal", "RefusalTally", "refusal_kind"]

REFUSAL_LOG_S = 10.0
"""Seconds between two lines about a consumer's refusals (at most one line per interval)."""


class Refusal(NamedTuple):
    """One entry to dead-letter: ``entry`` (its id, or the Delivery), why, and what it is
    counted as in the log line (``kind``; default: the reason up to its first ':').
    ``raw``: the bytes kept in the DeadLetter (default: a Delivery's message re-encoded)."""

    entry: str | Delivery
    reason: str
    kind: str = ""
    raw: bytes = b""


def refusal_kind(reason: str, kind: str = "") -> str:
    """What a refusal is counted as: ``kind``, else the reason up to its first ':'."""
    return kind or reason.partition(":")[0]


class RefusalTally:
    """Refusals of one consumer since its last line (see the module docstring)."""

    def __init__(self, stream: str, group: str, interval_s: float = REFUSAL_LOG_S) -> None:
        self.stream, self.group, self.interval_s = stream, group, interval_s
        self.counts: dict[str, int] = {}
        self.examples: dict[str, str] = {}
        """Kind -> the first refusal of that kind since the last line (``id: reason``)."""
        self.dropped = 0
        self.since = -math.inf
        """When the last line was said (its interval counts from there)."""

    def add(self, refusals: Sequence[tuple[str, str, str]], dropped: int = 0) -> None:
        """Count ``(entry id, reason, kind)`` refusals, and ``dropped`` older dead letters
        trimmed by the dead-letter stream's cap."""
        for eid, reason, kind in refusals:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.examples.setdefault(kind, f"{eid}: {reason}")
        self.dropped += dropped

    def line(self, now: float) -> str | None:
        """The line to say at ``now``: None while nothing was counted or the interval since
        the last line is not over; else the counts, which start again from zero."""
        if not (self.counts or self.dropped) or now - self.since < self.interval_s:
            return None
        total = sum(self.counts.values())
        window = "" if math.isinf(self.since) else f" in the last {now - self.since:.0f} s"
        kinds = ", ".join(f"{n} {kind} (e.g. {self.examples[kind]})"
                          for kind, n in sorted(self.counts.items(), key=lambda kv: -kv[1]))
        text = (f"refused {total} entr{'y' if total == 1 else 'ies'} of {self.stream} "
                f"(group {self.group}){window}: {kinds}")
        if self.dropped:
            text += (f"; {self.dropped} older dead letter(s) dropped (the dead-letter stream "
                     "is at its cap)")
        self.counts, self.examples, self.dropped, self.since = {}, {}, 0, now
        return text
