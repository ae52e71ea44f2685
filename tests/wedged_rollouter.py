"""A rollouter whose generation never returns while its pulse goes on (a wedged GPU, engine
or driver call): ``python -m tests.wedged_rollouter`` takes the rollouter's arguments.

Its first batch blocks the worker thread for ever; the event loop, the liveness key and the
heartbeat stay fresh, and the heartbeat's progress counter stays put. It never exits by
itself: the test kills it.
"""

from __future__ import annotations

import threading
from typing import Any

import rollouter.batch
from rollouter import main


def _wedged(self: Any, seqs: Any, max_tokens: int) -> None:
    threading.Event().wait()


rollouter.batch.BatchRollout.generate = _wedged  # type: ignore[method-assign]
raise SystemExit(main())
