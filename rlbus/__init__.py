"""The app shell: the ``rlbus`` command (:mod:`rlbus.cli`), its launchers, inspect and traces.

Importing it makes an interrupt that nothing handled one line instead of a traceback: every
``rlbus`` process imports this package first (the console script and ``python -m rlbus``),
so a Ctrl-C that lands while the command is still importing (a third of a second, more on a
loaded machine: before ``rlbus up`` or a component has wired its own signal handling) ends it
with that line. The exit status stays the interrupt's (Python ends the process by SIGINT).
"""

from __future__ import annotations

import sys
from types import TracebackType

_DEFAULT_HOOK = sys.excepthook


def _interrupt_in_one_line(kind: type[BaseException], exc: BaseException,
                           tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        print("rlbus: interrupted (SIGINT) before it had started anything", file=sys.stderr,
              flush=True)
        return
    _DEFAULT_HOOK(kind, exc, tb)


sys.excepthook = _interrupt_in_one_line
