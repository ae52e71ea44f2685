"""``python -m profiler_service [--config FILE] [KEY=VALUE ...]``: the standalone profiler service.

The whole config is validated first (exit code 2 naming the key); the service also needs
``redis.url`` and ``run.id``. Exit code 0 when the run finished (or on a first SIGTERM or
SIGINT: a clean stop), 1 when Redis failed, 143 at a second signal.
"""

from __future__ import annotations

from runtime.process import entry_point

__all__ = ["main"]

main = entry_point("profiler", "profiler_service.service", "ProfilerService")
"""``rlbus profiler`` / ``python -m profiler_service``; returns the exit code. The service is
imported after the config check: a bad config exits before it is even loaded."""

if __name__ == "__main__":
    raise SystemExit(main())
