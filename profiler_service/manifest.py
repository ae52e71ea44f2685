"""The run's trace manifest: a pure function of the folded log, written atomically.

``save_path/RUN/manifest.json`` (``run.output_dir/profiles/RUN/`` when ``save_path`` is null)
lists one entry per ``(session, role, rank)``:

* ``scheduled``: a StartProfile was sent, nothing started yet;
* ``running``: a ProfileStarted arrived, no ProfileStopped yet;
* ``ok`` once the component stopped and the service found its trace file (``path``, relative
  to the manifest's folder) with the stated ``bytes``; ``unchecked`` until the service
  checked it (a manifest the service writes has checked every trace);
* ``partial``: as ``ok``, but the process died or restarted inside the session and the
  steps in ``missing_steps`` have no trace;
* ``lost``: the process died or restarted inside the session and no trace of it is left
  (``missing_steps`` lists the steps it had begun);
* ``missing``: the trace file the ProfileStopped names is not there (or has another size;
  ``reason`` says which), or the run is over and the process never reported the session
  stopped;
* the ProfileStopped's own status when it reports no trace (``missed``, ``cancelled``,
  ``unavailable``, ``error: ...``);
* ``not_reached``: the run ended before the session's first step.

Every entry has ``missing_steps`` (a list of steps, usually empty) and, for ``partial``,
``lost`` and a checked trace found ``missing``, a ``reason``.

Entries come in the order the sessions were sent, then targets in role/rank order; a
ProfileStopped from a process the session no longer targets (the run resumed with fewer
replicas) still gets its entry (at the end). Reports for sessions the service never sent are
not counted at all (:func:`~profiler_service.state.report_refusal`).
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from bus import validate_run_id
from profiler_service.records import (
    PROFILER_SOURCE,
    TRACE_MISSING_CODE,
    ServiceState,
    Session,
    StopFact,
    TraceChecked,
    expected_targets,
    stop_is_ok,
)
from profiler_service.schedule import MANIFEST_NAME
from runconfig.schema import Config
from runschema.messages import ProfileStopped, WarningRaised
from storage.files import atomic_write

__all__ = [
    "build_manifest",
    "check_trace",
    "check_traces",
    "manifest_file",
    "profile_dir",
    "trace_warning",
    "write_manifest",
]


def profile_dir(cfg: Config) -> Path:
    """``global_profiler.save_path/RUN`` (or ``run.output_dir/profiles/RUN``); not created.

    The same rule as ``profiling.paths.profile_root`` (which the components use), restated
    here so the service does not import the profiling package, and with it torch.
    """
    if cfg.run.id is None:
        raise ValueError("the profile folder needs a run id (run.id is not set)")
    save = cfg.global_profiler.save_path
    base = Path(save) if save is not None else Path(cfg.run.output_dir) / "profiles"
    return base / validate_run_id(cfg.run.id)


def manifest_file(cfg: Config) -> Path:
    """Where the manifest of ``cfg``'s run lives."""
    return profile_dir(cfg) / MANIFEST_NAME


def _relative_trace_path(raw: str) -> str:
    """A trace path as the manifest records it: POSIX, relative to the manifest's folder.

    Components report paths relative to ``save_path/RUN`` already; anything that is absolute
    or climbs out with ``..`` cannot be expressed relative to the folder and is dropped, so
    the manifest never points a reader outside it.
    """
    if not raw:
        return ""
    path = PurePosixPath(raw.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts:
        return ""
    return str(path)


def check_trace(folder: Path, stopped: ProfileStopped, tool: str) -> str:
    """"" when the trace ``stopped`` names is a regular file inside ``folder``
    (``save_path/RUN``) of ``stopped.bytes`` bytes, else what is wrong. An nsys session's
    stop names no file (nsys writes its own reports) and passes when it says so. File I/O:
    the service calls it on a worker thread."""
    relative = _relative_trace_path(stopped.path)
    if not relative:
        if tool == "nsys" and not stopped.path and stopped.bytes == 0:
            return ""
        return f"the ProfileStopped names no trace file inside {folder} ({stopped.path!r})"
    path = folder / relative
    try:
        if not path.resolve().is_relative_to(folder.resolve()):
            return f"{relative} leads out of {folder}"
        info = path.stat()
    except FileNotFoundError:
        return f"{relative} does not exist in {folder}"
    except OSError as exc:
        return f"{relative} cannot be read: {exc.strerror or exc}"
    if not stat.S_ISREG(info.st_mode):
        return f"{relative} in {folder} is not a regular file"
    if info.st_size != stopped.bytes:
        return (f"{relative} in {folder} has {info.st_size} bytes, the ProfileStopped says "
                f"{stopped.bytes}")
    return ""


def check_traces(
    folder: Path, sessions_stops: Iterable[tuple[str, StopFact, str]]
) -> list[TraceChecked]:
    """:func:`check_trace` for each ``(session_id, stop, tool)``, as facts to fold."""
    return [
        TraceChecked(session_id=sid, role=fact.role, rank=fact.rank, stopped=fact.stopped,
                     problem=check_trace(folder, fact.stopped, tool))
        for sid, fact, tool in sessions_stops
    ]


def trace_warning(checked: TraceChecked) -> WarningRaised:
    """The warning the service publishes (once) for a trace found missing."""
    return WarningRaised(
        source=PROFILER_SOURCE,
        code=TRACE_MISSING_CODE,
        message=f"session {checked.session_id} {checked.role}{checked.rank}: "
        f"{checked.problem}; marked missing in the manifest",
    )


def _stopped_fields(stopped: ProfileStopped) -> dict[str, Any]:
    return {
        "first_step": stopped.first_step,
        "last_step": stopped.last_step,
        "tool": stopped.tool,
        "path": _relative_trace_path(stopped.path),
        "bytes": stopped.bytes,
        "status": stopped.status or "ok",
        "duration_s": stopped.duration_s,
    }


def _steps(first: int, last: int, lo: int, hi: int) -> range:
    """Steps ``first..last`` within the session's ``lo..hi``."""
    return range(max(first, lo), min(last, hi) + 1)


def _missing_steps(session: Session, role: str, rank: int, end: int | None,
                   final: bool) -> list[int]:
    """Steps of ``session`` that ``(role, rank)`` began and whose trace is lost: the lost
    steps, less those its checked trace holds and (while the run goes on) those its
    successor's run in progress will profile; only steps of the session, up to the run's
    last one."""
    cmd = session.cmd
    assert cmd is not None  # only sent sessions have reports (state.report_refusal)
    lo = cmd.first_step
    hi = cmd.last_step if end is None else min(cmd.last_step, end)
    gone: set[int] = set()
    for part in session.lost_of(role, rank):
        gone.update(_steps(part.first, hi if part.last is None else part.last, lo, hi))
    fact = session.stop_of(role, rank)
    if fact is not None and stop_is_ok(fact.stopped) and fact.check == "":
        gone.difference_update(range(fact.stopped.first_step, fact.stopped.last_step + 1))
    run = session.run_of(role, rank)
    if run is not None and not final:
        gone.difference_update(_steps(run.step, hi, lo, hi))
    return sorted(gone)


def _status(entry: dict[str, Any], session: Session, role: str, rank: int,
            missing: list[int]) -> tuple[str, str]:
    """The entry's status before the run is over, and a problem found with its trace."""
    fact = session.stop_of(role, rank)
    lost = bool(session.lost_of(role, rank))
    if fact is None:
        if session.run_of(role, rank) is not None:
            return "running", ""
        return ("lost" if lost else entry["status"]), ""
    if not stop_is_ok(fact.stopped):
        return ("lost" if lost else entry["status"]), ""
    if fact.check is None:
        return "unchecked", ""
    if fact.check:
        return "missing", fact.check
    return ("partial" if missing else "ok"), ""


def _settle(entry: dict[str, Any], session: Session, role: str, rank: int, end: int | None,
            final: bool) -> None:
    """Fill in what ``(role, rank)`` reported of ``session``: its stop, the steps lost to a
    process that died or restarted inside it, and the entry's status."""
    fact = session.stop_of(role, rank)
    if fact is not None:
        entry.update(_stopped_fields(fact.stopped))
    missing = _missing_steps(session, role, rank, end, final)
    status, problem = _status(entry, session, role, rank, missing)
    if final and status in ("scheduled", "running"):
        never_started = end is not None and entry["first_step"] > end
        status = "not_reached" if never_started else "missing"
    entry["status"] = status
    entry["missing_steps"] = missing
    reasons = [problem] if problem else []
    if missing or status == "lost" or problem:
        reasons += dict.fromkeys(part.reason for part in session.lost_of(role, rank))
    if reasons:
        entry["reason"] = "; ".join(reasons)


def build_manifest(run_id: str, state: ServiceState, final: bool = False) -> dict[str, Any]:
    """The manifest implied by the folded log ``state``.

    ``final`` (or a ProfilerFinished, or the service's give-up warning, in the log) turns
    sessions still ``scheduled``/``running`` into ``missing`` (or ``not_reached``).
    O(sessions x steps): the service rebuilds it only when a session fact changed, off its
    loop.
    """
    final = final or state.profiler_finished or state.gave_up_waiting
    end = state.run_finished.steps if state.run_finished is not None else None
    entries: dict[tuple[str, str, int], dict[str, Any]] = {}
    for cmd in state.sent_sessions():
        session = state.sessions[cmd.session_id]
        for role, rank in expected_targets(cmd.roles, state.replicas, cmd.ranks,
                                           trainers=state.trainers):
            if (cmd.session_id, role, rank) in entries:
                continue
            entry: dict[str, Any] = {
                "id": cmd.session_id,
                "role": role,
                "rank": rank,
                "first_step": cmd.first_step,
                "last_step": cmd.last_step,
                "tool": cmd.tool,
                "path": "",
                "bytes": 0,
                "status": "running" if (role, rank) in session.started else "scheduled",
                "request_id": cmd.request_id,
            }
            _settle(entry, session, role, rank, end, final)
            entries[(cmd.session_id, role, rank)] = entry
    # A process the session no longer targets (a resumed run with fewer replicas) that
    # reported a stop still gets its entry, at the end, in the order its report arrived.
    unexpected = [
        (fact.order, session, fact)
        for session in state.sessions.values()
        for fact in session.stops
        if (session.session_id, fact.role, fact.rank) not in entries
    ]
    unexpected.sort(key=lambda item: item[0])
    for _, session, fact in unexpected:
        assert session.cmd is not None
        entry = {"id": session.session_id, "role": fact.role, "rank": fact.rank,
                 "request_id": session.cmd.request_id}
        _settle(entry, session, fact.role, fact.rank, end, final)
        entries[(session.session_id, fact.role, fact.rank)] = entry
    return {"run_id": run_id, "sessions": list(entries.values())}


def write_manifest(path: Path, manifest: dict[str, Any]) -> bool:
    """Write ``manifest`` to ``path`` atomically (temp file, fsync, rename).

    Returns False, without touching the file, when it already holds exactly this content, so
    the service can call it after every batch of entries.
    """
    text = json.dumps(manifest, indent=2, sort_keys=False) + "\n"
    try:
        if path.read_text() == text:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text.encode())
    return True
