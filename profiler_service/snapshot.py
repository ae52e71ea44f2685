"""Snapshots of the profiler service's folded state: :class:`Snapshot` is a state and the
positions in the log it was folded up to, written by the service so that a restart reads only
the log after it. A cache of the log, never a source of facts: a file of another format, or
corrupt bytes, decodes to None and the service folds the whole log instead."""

from __future__ import annotations

import msgspec

from profiler_service.pmap import PMap
from profiler_service.records import PendingRequest, ServiceState, Session, lowest_last_step
from runschema.messages import RunFinished, RunStarted

__all__ = ["SNAPSHOT_FORMAT", "Snapshot", "decode_snapshot", "encode_snapshot"]

SNAPSHOT_FORMAT = 2
"""Version of :class:`Snapshot`'s layout; a file of another version is ignored."""


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A folded state and where in the log it was folded up to (the tracking positions), as
    stored by the service so that a restart reads only the log after it."""

    state: ServiceState
    run_id: str
    events_position: str
    """Id of the last events entry folded into ``state`` (every one before it is folded)."""
    control_position: str = ""
    """Id of the last control entry the service knew of ("" for none)."""
    log_positions: dict[str, str] = {}
    """Per role other than the trainer's: the id of the last entry of its stream of the log
    folded into ``state`` (bus.RunKeys.log)."""


class _SnapshotFile(msgspec.Struct, frozen=True, kw_only=True):
    format: int
    run_id: str
    events_position: str
    control_position: str
    run_started: RunStarted | None
    ready_since_run_started: bool
    run_finished: RunFinished | None
    gave_up_waiting: bool
    profiler_finished: bool
    last_started_step: int
    sessions: list[Session]
    sent: int
    stop_reports: int
    answered: list[str]
    pending: list[PendingRequest]
    running: list[tuple[str, str, int]]
    unchecked: list[tuple[str, str, int]]
    trace_warnings: list[str]
    log_positions: dict[str, str] = {}
    last_finished_step: int = 0


def encode_snapshot(snapshot: Snapshot) -> bytes:
    """``snapshot`` as msgpack bytes. O(sessions)."""
    state = snapshot.state
    return msgspec.msgpack.encode(
        _SnapshotFile(
            format=SNAPSHOT_FORMAT,
            run_id=snapshot.run_id,
            events_position=snapshot.events_position,
            control_position=snapshot.control_position,
            run_started=state.run_started,
            ready_since_run_started=state.ready_since_run_started,
            run_finished=state.run_finished,
            gave_up_waiting=state.gave_up_waiting,
            profiler_finished=state.profiler_finished,
            last_started_step=state.last_started_step,
            last_finished_step=state.last_finished_step,
            sessions=sorted(state.sessions.values(), key=lambda s: s.session_id),
            sent=state.sent,
            stop_reports=state.stop_reports,
            answered=sorted(state.answered),
            pending=list(state.pending),
            running=list(state.running),
            unchecked=list(state.unchecked),
            trace_warnings=sorted(state.trace_warnings),
            log_positions=dict(snapshot.log_positions),
        )
    )


def decode_snapshot(data: bytes) -> Snapshot | None:
    """The snapshot in ``data``; None if it is not one this code wrote (other format,
    corrupt bytes): the caller then folds the whole log."""
    try:
        raw = msgspec.msgpack.decode(data, type=_SnapshotFile)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if raw.format != SNAPSHOT_FORMAT:
        return None
    sessions = PMap((s.session_id, s) for s in raw.sessions)
    sent = sorted((s for s in raw.sessions if s.cmd is not None), key=lambda s: s.seq)
    still = tuple(s.cmd for s in sent if s.cmd is not None
                  and s.cmd.last_step > raw.last_started_step)
    state = ServiceState(
        run_started=raw.run_started,
        ready_since_run_started=raw.ready_since_run_started,
        run_finished=raw.run_finished,
        gave_up_waiting=raw.gave_up_waiting,
        profiler_finished=raw.profiler_finished,
        last_started_step=raw.last_started_step,
        last_finished_step=raw.last_finished_step,
        sessions=sessions,
        sent=raw.sent,
        stop_reports=raw.stop_reports,
        answered=PMap((rid, True) for rid in raw.answered),
        pending=tuple(raw.pending),
        open_sessions=still,
        open_until=lowest_last_step(still),
        running=tuple(raw.running),
        unchecked=tuple(raw.unchecked),
        trace_warnings=PMap((message, True) for message in raw.trace_warnings),
    )
    return Snapshot(
        state=state,
        run_id=raw.run_id,
        events_position=raw.events_position,
        control_position=raw.control_position,
        log_positions=dict(raw.log_positions),
    )
