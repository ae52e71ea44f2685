"""Signals for ``rlbus up``, recorded from the first moment and acted on between stages.

Kept apart from :mod:`rlbus.launcher` (which imports the bus and psutil) so that the CLI can
install a :class:`Supervisor` before it loads anything else: a Ctrl-C while ``rlbus up`` loads
its config is then recorded, and the launcher stops at its first check.
"""

from __future__ import annotations

import contextlib
import signal
from types import FrameType
from typing import Any

__all__ = ["SIGNAL_NAMES", "Interrupted", "Supervisor"]

SIGNAL_NAMES: dict[int, str] = {
    signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP",
    signal.SIGPIPE: "SIGPIPE (stdout was closed)"}


class Interrupted(Exception):
    """A signal (or a closed stdout) arrived: stop what has started."""


class Supervisor:
    """Records SIGINT/SIGTERM/SIGHUP instead of raising (``install`` / ``restore``), and a
    closed stdout as SIGPIPE (``stdout_closed``)."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)  # only an append: safe whatever the main thread holds

    def install(self) -> Supervisor:
        """Catch the signals (again: ``ray.init`` replaces the SIGTERM handler). A SIGHUP
        ignored by whoever started ``rlbus up`` (``nohup``) stays ignored."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            current = signal.getsignal(sig)
            if sig == signal.SIGHUP and current == signal.SIG_IGN:
                continue
            previous = signal.signal(sig, self._on_signal)
            self._previous.setdefault(sig, previous)
        return self

    def restore(self) -> None:
        for sig, old in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)
        self._previous.clear()

    def stdout_closed(self) -> None:
        """The reader of stdout went away (``| head``): stop as for a signal, once."""
        if signal.SIGPIPE not in self.signals:
            self.signals.append(signal.SIGPIPE)

    def check(self) -> None:
        """Raise :class:`Interrupted` when a signal has arrived."""
        if self.signals:
            raise Interrupted

    @property
    def cancelled(self) -> bool:
        return bool(self.signals)

    @property
    def exit_code(self) -> int:
        return 128 + self.signals[0] if self.signals else 0

    @property
    def first(self) -> str:
        """The first signal's name."""
        sig = self.signals[0]
        return SIGNAL_NAMES.get(sig, str(sig))
