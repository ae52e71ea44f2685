"""The profiler service's finish hook, run at most once per run.

``global_profiler.finish_hook_cmd`` (from the service's own config file, never from a
message) runs after the run's last session. A marker file beside the manifest records that it
started, then how it ended, so a service that dies between running the hook and publishing
ProfilerFinished never runs it a second time: a restarted service finds the exit code (and
reports it), or a start without an end (and says the hook was interrupted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

from storage.files import atomic_write

__all__ = ["HOOK_INTERRUPTED_CODE", "HOOK_MARKER_NAME", "HOOK_TIMEOUT_S", "EarlierRun",
           "FinishHook"]

log = logging.getLogger("profiler_service")

HOOK_MARKER_NAME = ".finish_hook.json"
"""Marker in ``save_path/RUN`` recording that the finish hook started and how it ended, so a
service that crashes between running the hook and publishing ProfilerFinished does not run
it a second time."""

HOOK_INTERRUPTED_CODE = "finish_hook_interrupted"
"""WarningRaised code: the hook's marker says it started but never ended (the service died)."""

HOOK_TIMEOUT_S = 600.0
"""Longest a finish hook may run before it is killed (its exit code is then recorded as -9)."""


class EarlierRun(NamedTuple):
    """What the marker says of an earlier run of the hook."""

    rc: int | None
    """Its exit code; None when it started and never ended."""

    @property
    def interrupted(self) -> bool:
        return self.rc is None

    @property
    def message(self) -> str:
        return ("the finish hook was started by an earlier profiler service that died before "
                "it ended; not running it a second time (at most once)")


class FinishHook:
    """``cmd``, run at most once as recorded in ``marker``."""

    def __init__(self, cmd: str, marker: Path) -> None:
        self.cmd = cmd
        self.marker = marker

    async def earlier(self) -> EarlierRun | None:
        """The earlier run the marker records, if any."""
        previous = await asyncio.to_thread(_read_marker, self.marker)
        if previous is None:
            return None
        rc = previous.get("rc")
        if isinstance(rc, int):
            log.info("finish hook already ran (exit code %d); not running it again", rc)
            return EarlierRun(rc)
        return EarlierRun(None)

    async def run(self, env: dict[str, str]) -> int:
        """Run the command (an asyncio subprocess: the loop and the pulse go on; killed after
        :data:`HOOK_TIMEOUT_S`), recording its start and its end; its exit code."""
        started = time.time()
        await asyncio.to_thread(_write_marker, self.marker, {"started": started})
        log.info("running finish hook: %s", self.cmd)
        proc = await asyncio.create_subprocess_shell(self.cmd, env=env)
        try:
            rc = await asyncio.wait_for(proc.wait(), HOOK_TIMEOUT_S)
        except TimeoutError:
            log.error("finish hook ran over %.0f s; killing it", HOOK_TIMEOUT_S)
            proc.kill()
            rc = await proc.wait()
        await asyncio.to_thread(_write_marker, self.marker, {"started": started, "rc": rc})
        log.info("finish hook exited with code %d", rc)
        return rc


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: something ran; do not run the hook again
    return data if isinstance(data, dict) else {}


def _write_marker(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(data).encode())
