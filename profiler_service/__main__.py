"""``python -m profiler_service [--config FILE] [KEY=VALUE ...]``: the standalone profiler service.

The whole config is validated first (exit code 2 naming the key); the service also needs
``redis.url`` and ``run.id``. Exit code 0 when the run finished (or on a first SIGTERM or
SIGINT: a clean stop), 1 when Redis failed, 143 at a second signal.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from runconfig import load_or_exit

__all__ = ["PROG", "main"]

PROG = "rlbus profiler"


def _missing(key: str, why: str) -> int:
    print(f"{PROG}: error: invalid config key '{key}': {why}", file=sys.stderr, flush=True)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    cfg = load_or_exit(list(sys.argv[1:] if argv is None else argv), PROG)
    if cfg.redis.url is None:
        return _missing("redis.url", "the profiler service needs a Redis URL (redis://HOST:PORT)")
    if cfg.run.id is None:
        return _missing("run.id", "the profiler service needs the id of the run to follow")
    logging.basicConfig(
        level=logging.INFO,
        format="profiler: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # The bus's per-retry lines are for debugging; an unreachable Redis ends in one line.
    logging.getLogger("bus").setLevel(logging.WARNING)
    # Imported after the config check: a bad config exits before the service is even loaded.
    from bus import run_with_bus
    from profiler_service.service import serve

    # A first SIGTERM/SIGINT stops the service cleanly (its manifest written, exit code 0).
    stop = asyncio.Event()
    return run_with_bus(cfg.redis.url, PROG, lambda bus: serve(cfg, bus, stop), stop=stop,
                        client_name=f"rlbus-profiler-{cfg.run.id}")


if __name__ == "__main__":
    raise SystemExit(main())
