"""The profiler service's files in ``save_path/RUN``: the manifest and the snapshot.

- The **manifest** (:mod:`profiler_service.manifest`) is rewritten when the parts of the
  state it depends on change, at most every :data:`MANIFEST_EVERY_S` while the run goes on
  (changes in between are coalesced), and at once when final.
- The **snapshot** (:class:`~profiler_service.snapshot.Snapshot`, :data:`SNAPSHOT_NAME`) is the
  folded state and its tracking positions, written at most every :data:`SNAPSHOT_EVERY_S`, so
  that a restarted service reads only the log after it. It is a cache of the log, never a
  source of facts: :meth:`ServiceFiles.load_snapshot` takes it only when the log still holds
  the entries it names.

Every write is atomic and runs on a worker thread (the state is frozen, so the thread reads
it safely while the loop goes on).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from bus import Bus, RunKeys
from profiler_service.manifest import build_manifest, manifest_file, profile_dir, write_manifest
from profiler_service.records import PROFILER_SOURCE, ServiceState
from profiler_service.snapshot import Snapshot, decode_snapshot, encode_snapshot
from runconfig.schema import Config
from storage.files import atomic_write

__all__ = ["MANIFEST_EVERY_S", "SNAPSHOT_EVERY_S", "SNAPSHOT_NAME", "ServiceFiles"]

log = logging.getLogger("profiler_service")

SNAPSHOT_NAME = ".profiler_state.msgpack"
"""The service's snapshot in ``save_path/RUN``: its folded state and tracking positions
(:class:`~profiler_service.snapshot.Snapshot`). A cache of the log, never a source of facts."""

SNAPSHOT_EVERY_S = 5.0
"""Shortest time between two snapshot writes (one is also written on a clean exit)."""

MANIFEST_EVERY_S = 0.5
"""Shortest time between two manifest writes while the run goes on (the final one is
written at once); changes in between are coalesced."""


class ServiceFiles:
    """The manifest and the snapshot of run ``keys.run_id``."""

    def __init__(self, cfg: Config, bus: Bus, keys: RunKeys) -> None:
        self.cfg, self.bus, self.keys = cfg, bus, keys
        self.profile_dir = profile_dir(cfg)
        self.manifest_path = manifest_file(cfg)
        self.snapshot_path = self.profile_dir / SNAPSHOT_NAME
        self._manifest_inputs: tuple[Any, ...] | None = None
        self._manifest_due = 0.0
        self._snapshot_of: tuple[ServiceState, str] | None = None
        self._snapshot_due = 0.0

    async def load_snapshot(self) -> Snapshot | None:
        """The snapshot next to the manifest, if the log confirms it."""
        if self.cfg.global_profiler.tool is None:
            return None
        data = await asyncio.to_thread(_read_bytes, self.snapshot_path)
        if data is None:
            return None
        snapshot = decode_snapshot(data)
        if snapshot is None or snapshot.run_id != self.keys.run_id:
            log.info("ignoring %s (not a snapshot of this run); reading the whole log",
                     self.snapshot_path)
            return None
        # Ask the trainer's events trim to keep what follows the snapshot (honoured while
        # our liveness key exists) before checking that it is still there.
        await self.bus.set_position(self.keys.position(PROFILER_SOURCE),
                                    snapshot.events_position)
        # A snapshot says what the log held up to its positions. If the log lacks them (a
        # Redis that lost its tail, or a new run reusing the id) the log wins.
        checks = [(self.keys.events, snapshot.events_position),
                  *((self.keys.log(role), position) for role, position
                    in snapshot.log_positions.items() if position not in ("", "0"))]
        if snapshot.control_position:
            checks.append((self.keys.control, snapshot.control_position))
        for stream, position in checks:
            if not await self.bus.read_ids(stream, [position]):
                log.warning("snapshot %s names entry %s of %s, which the log does not hold; "
                            "reading the whole log", self.snapshot_path, position, stream)
                return None
        return snapshot

    async def write_manifest(self, state: ServiceState, final: bool = False) -> None:
        """Write the manifest of ``state`` (worker thread)."""
        self._manifest_inputs = _manifest_inputs(state)
        entries = await asyncio.to_thread(
            _write_manifest_file, self.manifest_path, self.keys.run_id, state, final
        )
        if entries is not None:
            log.info("manifest %s: %d entries", self.manifest_path, entries)

    async def write_snapshot(self, snapshot: Snapshot) -> None:
        """Store ``snapshot`` (worker thread) unless this very state at this very position
        is stored already; then the trainer's events trim keeps what follows it while we
        are alive."""
        last = self._snapshot_of
        if last is not None and last[0] is snapshot.state and last[1] == snapshot.events_position:
            return
        await asyncio.to_thread(_write_snapshot_file, self.snapshot_path, snapshot)
        self._snapshot_of = (snapshot.state, snapshot.events_position)
        await self.bus.set_position(self.keys.position(PROFILER_SOURCE),
                                    snapshot.events_position)

    def manifest_due(self, state: ServiceState, now: float) -> bool:
        """Whether the manifest's inputs changed and its next write is due (the due time
        then moves on)."""
        inputs = _manifest_inputs(state)
        stale = self._manifest_inputs is None or any(
            a is not b for a, b in zip(inputs, self._manifest_inputs, strict=True)
        )
        if not stale or now < self._manifest_due:
            return False
        self._manifest_due = now + MANIFEST_EVERY_S
        return True

    def snapshot_due(self, now: float) -> bool:
        """Whether a snapshot write is due (the due time then moves on)."""
        if now < self._snapshot_due:
            return False
        self._snapshot_due = now + SNAPSHOT_EVERY_S
        return True


def _manifest_inputs(state: ServiceState) -> tuple[Any, ...]:
    """The parts of the state the manifest depends on (compared by identity: each is
    replaced, never changed, so a new object means a change)."""
    return (
        state.sessions,
        state.run_started,
        state.run_finished,
        state.profiler_finished,
        state.gave_up_waiting,
    )


def _write_manifest_file(path: Path, run_id: str, state: ServiceState, final: bool) -> int | None:
    """Build and write the manifest (worker thread); its entry count if the file changed."""
    manifest = build_manifest(run_id, state, final=final)
    if write_manifest(path, manifest):
        return len(manifest["sessions"])
    return None


def _write_snapshot_file(path: Path, snapshot: Snapshot) -> None:
    """Encode and write ``snapshot`` atomically (worker thread)."""
    atomic_write(path, encode_snapshot(snapshot))


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None
