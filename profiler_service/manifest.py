"""The run's trace manifest: a pure function of the folded log, written atomically.

``save_path/RUN/manifest.json`` (``run.output_dir/profiles/RUN/`` when ``save_path`` is null)
lists one entry per ``(session, role, rank)``:

* ``scheduled``: a StartProfile was sent, nothing started yet;
* ``running``: a ProfileStarted arrived, no ProfileStopped yet;
* the ProfileStopped ``status`` (``ok`` normally) once the component stopped, with its trace
  ``path`` (relative to the manifest's folder) and ``bytes``;
* ``missing``: the run is over and the process never reported the session stopped;
* ``not_reached``: the run ended before the session's first step.

Entries come in the order the sessions were sent, then targets in role/rank order; a
ProfileStopped for a session or process nobody expected still gets its entry (at the end).
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from bus.files import atomic_write
from bus.keys import validate_run_id
from bus.messages import ProfileStopped
from profiler_service.schedule import MANIFEST_NAME, expected_targets
from profiler_service.state import ServiceState
from runconfig.schema import Config

__all__ = [
    "build_manifest",
    "manifest_file",
    "profile_dir",
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


def build_manifest(run_id: str, state: ServiceState, final: bool = False) -> dict[str, Any]:
    """The manifest implied by the folded log ``state``.

    ``final`` (or a ProfilerFinished, or the service's give-up warning, in the log) turns
    sessions still ``scheduled``/``running`` into ``missing`` (or ``not_reached``).
    O(sessions): the service rebuilds it only when a session fact changed, off its loop.
    """
    final = final or state.profiler_finished or state.gave_up_waiting
    last_step = state.run_finished.steps if state.run_finished is not None else None
    entries: dict[tuple[str, str, int], dict[str, Any]] = {}
    for cmd in state.sent_sessions():
        session = state.sessions[cmd.session_id]
        for role, rank in expected_targets(cmd.roles, state.replicas, cmd.ranks):
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
            fact = session.stop_of(role, rank)
            if fact is not None:
                entry.update(_stopped_fields(fact.stopped))
            entries.setdefault((cmd.session_id, role, rank), entry)
    # A ProfileStopped nobody expected (unknown session or process) still gets its entry, at
    # the end, in the order those reports first arrived.
    unexpected = [
        (fact.order, session.session_id, fact)
        for session in state.sessions.values()
        for fact in session.stops
        if (session.session_id, fact.role, fact.rank) not in entries
    ]
    unexpected.sort(key=lambda item: item[0])
    for _, sid, fact in unexpected:
        entries[(sid, fact.role, fact.rank)] = {
            "id": sid,
            "role": fact.role,
            "rank": fact.rank,
            "request_id": "",
            **_stopped_fields(fact.stopped),
        }
    if final:
        for entry in entries.values():
            if entry["status"] in ("scheduled", "running"):
                never_started = last_step is not None and entry["first_step"] > last_step
                entry["status"] = "not_reached" if never_started else "missing"
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
