"""``python -m profiler_service [--config FILE] [KEY=VALUE ...]``: the standalone profiler service.

The whole config is validated first (exit code 2 naming the key); the service also needs
``redis.url`` and ``run.id``. Exit code 0 when the run finished (or on a first SIGTERM or
SIGINT: a clean stop), 1 when Redis failed, 143 at a second signal.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime import main as run_main

__all__ = ["main"]


def _service() -> type:
    # Imported after the config check: a bad config exits before the service is even loaded.
    from profiler_service.service import ProfilerService

    return ProfilerService


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``rlbus profiler`` too); returns the exit code."""
    return run_main("profiler", _service, argv)


if __name__ == "__main__":
    raise SystemExit(main())
