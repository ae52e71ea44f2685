"""A component's wall time, lap by lap: what its event loop did, named, adding up.

:class:`Laps` cuts a clock into *windows* (a trainer step, a rollouter's heartbeat
interval). Inside a window the component calls :meth:`Laps.lap` after each thing it does,
naming it: the time since the previous lap goes to that name. The laps therefore add up to
the window exactly, and the windows tile the clock; what such accounting can get wrong is a
name, never a sum. A window is closed by the loop that laps (:meth:`Laps.close`: a trainer
step) or taken by another task (:meth:`Laps.take`: a rollouter's heartbeat). The names are
fixed when the clock is made (a name not among them is a bug, refused), so every window
reports all of them, zeros included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

__all__ = ["Laps"]


class Laps:
    """The current window's laps over ``names``; reported as ``PREFIX<name>`` and
    ``PREFIX<total>`` (the window's wall time, their sum)."""

    def __init__(self, names: Sequence[str], *, prefix: str, total: str,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.names = tuple(names)
        self._prefix, self._total, self._clock = prefix, total, clock
        self._mark = self._opened = clock()
        self._spent = dict.fromkeys(self.names, 0.0)

    def lap(self, name: str) -> None:
        """The time since the previous lap was spent on ``name``."""
        now = self._clock()
        self._spent[name] += now - self._mark  # KeyError: a name not in names
        self._mark = now

    def close(self, name: str) -> dict[str, float]:
        """Lap ``name``, end the window and open the next one: every name's seconds and
        the window's (their sum)."""
        self.lap(name)
        out = {self._prefix + n: spent for n, spent in self._spent.items()}
        out[self._prefix + self._total] = self._mark - self._opened
        self._opened = self._mark
        self._spent = dict.fromkeys(self.names, 0.0)
        return out

    def take(self) -> dict[str, float]:
        """The laps completed since the last take (or close), and their sum as the window;
        the lap under way goes to the next window. For a window cut by another task (a
        heartbeat), which cannot name what the loop is doing now."""
        out = {self._prefix + n: spent for n, spent in self._spent.items()}
        out[self._prefix + self._total] = sum(self._spent.values())
        self._spent = dict.fromkeys(self.names, 0.0)
        return out
