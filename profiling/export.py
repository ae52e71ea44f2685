"""Writing a stopped session's files, on or off the component's critical path.

When a profiled session ends, the agent stops its recorders on the step thread (torch.profiler
is stopped on the thread it started on, and the CUDA allocator snapshot is taken at that
moment) and hands what they recorded to an exporter as a :class:`FinishedSession`. Writing it
(``export_chrome_trace``, the top ops, the gzip with rlbus's metadata, the rename, the
``sessions/`` link, a memory snapshot's pickle) is :meth:`TraceWriter.write`, which never
raises and returns the events to publish, ProfileStopped last: ProfileStopped is built only
once the trace is fully written under its final name.

* :class:`InlineExporter` writes at once, on the calling thread (the agent's default: its
  calls return the ProfileStopped they caused).
* :class:`BackgroundExporter` writes on one dedicated thread, so the step that follows starts
  at once; its events come out of :meth:`~BackgroundExporter.ready` (the agent returns them
  from its next call) and :meth:`~BackgroundExporter.wait` (at close: every trace written).
  At most ``depth`` exports are in flight (one writing, the rest queued); a session that ends
  while the queue is full makes its step wait for the oldest export to finish (backpressure:
  no trace is dropped, and the stopped profilers held in memory stay bounded).
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from profiling.paths import session_view_path, trace_path, trace_world_size
from profiling.traces import finish_trace, link_session_view, top_ops
from runschema.messages import ProfileStarted, ProfileStopped, StartProfile, WarningRaised
from storage.files import atomic_file

if TYPE_CHECKING:  # torch is imported by the agent, not by this module
    import torch.profiler

__all__ = [
    "DEFAULT_DEPTH",
    "AgentEvent",
    "BackgroundExporter",
    "Exporter",
    "FinishedSession",
    "InlineExporter",
    "TraceWriter",
    "cut_frames",
    "describe_error",
]

AgentEvent = ProfileStarted | ProfileStopped | WarningRaised
"""What the agent asks its component to publish."""

Job = Callable[[], list[AgentEvent]]

DEFAULT_DEPTH = 2
"""Exports in flight at most in a :class:`BackgroundExporter`: one writing, one queued."""

_GZIP_LEVEL = 6  # level 9 is several times slower on large traces for a few % smaller files
_TOP_OPS_MAX_BYTES = 256 << 20  # above this, parsing the trace for top_ops costs too much


@dataclass(slots=True)
class FinishedSession:
    """What a stopped session leaves to write, taken on the step thread."""

    cmd: StartProfile
    first_step: int
    last_step: int
    duration_s: float
    status: str
    errors: list[str] = field(default_factory=list)
    """Errors while stopping: the session's status becomes the first one."""
    prof: torch.profiler.profile | None = None
    """The stopped torch.profiler whose trace is to be exported (None: no trace)."""
    snapshot: object = None
    """A CUDA allocator snapshot to pickle (torch_memory on CUDA), or None."""


@dataclass(frozen=True, slots=True)
class TraceWriter:
    """Writes one process's session files under ``run_dir`` (thread-safe: no state)."""

    run_dir: Path
    role: str
    rank: int
    run_id: str
    trace_rank: int
    world_size: int
    """The run's (profiling.paths.trace_world_size); a trace widens it to its session's ranks."""
    stack_depth: int = 0
    """Cut a memory snapshot's stacks to this many frames (0: keep them)."""
    trainers: int = 1
    """The run's trainer ranks (profiling.paths.trace_rank)."""

    def write(self, done: FinishedSession) -> list[AgentEvent]:
        """Write ``done``'s files; the warnings, then its ProfileStopped. Never raises."""
        errors = list(done.errors)
        events: list[AgentEvent] = []
        path, size = "", 0
        top: list[str] = []
        if done.snapshot is not None:
            try:
                self._write_memory_snapshot(done.cmd.session_id, done.snapshot)
            except Exception as exc:
                errors.append(f"memory snapshot: {describe_error(exc)}")
        if done.prof is not None:
            try:
                path, size, top = self._write_trace(done, done.prof, events)
            except Exception as exc:
                errors.append(f"writing trace: {describe_error(exc)}")
        status = done.status
        if errors:
            status = f"error: {errors[0]}"
            events.append(self.warn("profile_stop_failed",
                                    f"session {done.cmd.session_id!r}: {'; '.join(errors)}"))
        events.append(ProfileStopped(
            session_id=done.cmd.session_id, role=self.role, rank=self.rank,
            first_step=done.first_step, last_step=done.last_step, tool=done.cmd.tool,
            path=path, bytes=size, duration_s=done.duration_s, status=status, top_ops=top,
        ))
        return events

    def warn(self, code: str, message: str) -> WarningRaised:
        return WarningRaised(source=f"{self.role}{self.rank}", code=code, message=message)

    def _write_trace(
        self, done: FinishedSession, prof: torch.profiler.profile, events: list[AgentEvent]
    ) -> tuple[str, int, list[str]]:
        """``prof``'s Chrome trace -> patched gzip (:func:`~profiling.traces.finish_trace`)
        -> rename.

        Returns (path relative to run_dir, bytes, top ops); a failure to rank the ops or to
        link the session view only appends a warning to ``events`` (the trace is still good).
        """
        sid = done.cmd.session_id
        final = trace_path(self.run_dir, self.role, self.rank, sid, ".json.gz")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd, raw_name = tempfile.mkstemp(dir=self.run_dir, prefix=".tmp-", suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(raw_name)
            top: list[str] = []
            try:
                if os.path.getsize(raw_name) <= _TOP_OPS_MAX_BYTES:
                    with open(raw_name, "rb") as src:
                        top = top_ops(json.load(src))
            except Exception as exc:
                events.append(self.warn("profile_top_ops_failed", describe_error(exc)))
            metadata = {
                "role": self.role, "replica": self.rank, "run_id": self.run_id,
                "session_id": sid, "first_step": done.first_step,
                "last_step": done.last_step, "tool": done.cmd.tool,
            }
            # The session's own ranks may lie beyond the run's replicas (joined rollouters).
            world = max(self.world_size,
                        trace_world_size(0, self.trace_rank, done.cmd.ranks, self.trainers))
            size = finish_trace(
                Path(raw_name), final, self.trace_rank, world, metadata, _GZIP_LEVEL
            )
        finally:
            Path(raw_name).unlink(missing_ok=True)
        try:
            link_session_view(session_view_path(self.run_dir, sid, self.role, self.rank), final)
        except Exception as exc:
            message = f"sessions/ link: {describe_error(exc)}"
            events.append(self.warn("profile_view_failed", message))
        return final.name, size, top

    def _write_memory_snapshot(self, session_id: str, snapshot: object) -> None:
        """The CUDA allocator snapshot to ``{role}{rank}-{session}.pickle`` (atomic)."""
        final = trace_path(self.run_dir, self.role, self.rank, session_id, ".pickle")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.stack_depth > 0:
            cut_frames(snapshot, self.stack_depth)
        with atomic_file(final) as out:
            pickle.dump(snapshot, out)


class Exporter:
    """Runs the agent's export jobs; this base runs each at once (see InlineExporter)."""

    def submit(self, job: Job) -> list[AgentEvent]:
        """Hand over one job; the events that are ready now (this job's, when inline)."""
        return job()

    def ready(self) -> list[AgentEvent]:
        """Events of the jobs finished since the last call, in submission order."""
        return []

    def wait(self) -> list[AgentEvent]:
        """Wait for every job handed over; the events not returned yet."""
        return []

    def close(self) -> None:
        """Release the exporter's resources (after :meth:`wait`)."""


class InlineExporter(Exporter):
    """Writes on the calling thread: the call that ends a session returns its ProfileStopped."""


class BackgroundExporter(Exporter):
    """Writes on one dedicated thread, at most ``depth`` jobs in flight (see the module)."""

    def __init__(self, depth: int = DEFAULT_DEPTH) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlbus-trace-export")
        self._slots = threading.BoundedSemaphore(depth)
        self._lock = threading.Lock()
        self._pending: deque[Future[list[AgentEvent]]] = deque()

    def submit(self, job: Job) -> list[AgentEvent]:
        # Blocks while `depth` jobs are in flight: the ending step waits, no trace is lost.
        self._slots.acquire()
        try:
            future = self._pool.submit(self._run, job)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._pending.append(future)
        return self.ready()

    def _run(self, job: Job) -> list[AgentEvent]:
        try:
            return job()
        finally:
            self._slots.release()

    def ready(self) -> list[AgentEvent]:
        events: list[AgentEvent] = []
        with self._lock:
            # One worker: jobs finish in submission order; stop at the first unfinished one.
            while self._pending and self._pending[0].done():
                events += self._pending.popleft().result()
        return events

    def wait(self) -> list[AgentEvent]:
        with self._lock:
            futures = list(self._pending)
            self._pending.clear()
        events: list[AgentEvent] = []
        for future in futures:
            events += future.result()
        return events

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def cut_frames(snapshot: object, depth: int) -> None:
    """Keep the innermost ``depth`` frames of every stack in a CUDA memory snapshot."""
    def cut(item: object) -> None:
        if isinstance(item, dict):
            frames = item.get("frames")
            if isinstance(frames, list) and len(frames) > depth:
                item["frames"] = frames[:depth]
            for value in item.values():
                if isinstance(value, list | dict):
                    cut(value)
        elif isinstance(item, list):
            for value in item:
                cut(value)

    cut(snapshot)


def describe_error(exc: BaseException) -> str:
    """``Type: first line`` of an exception, bounded (it goes into events)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
