"""The run's trace manifest: a pure fold of the log, written atomically.

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
import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from bus.keys import validate_run_id
from bus.messages import Command, Event, ProfileStarted, ProfileStopped, StartProfile
from profiler_service.schedule import MANIFEST_NAME, expected_targets, fold_log
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


def build_manifest(
    run_id: str, seen: Sequence[Event | Command], final: bool = False
) -> dict[str, Any]:
    """The manifest implied by the log ``seen`` (events and control, any merge order).

    ``final`` (or a ProfilerFinished, or the service's give-up warning, in the log) turns
    sessions still ``scheduled``/``running`` into ``missing`` (or ``not_reached``).
    """
    view = fold_log(seen)
    final = final or view.profiler_finished or view.gave_up_waiting
    last_step = view.run_finished.steps if view.run_finished is not None else None
    entries: dict[tuple[str, str, int], dict[str, Any]] = {}

    for msg in seen:
        if isinstance(msg, StartProfile) and view.sent.get(msg.session_id) is msg:
            for role, rank in expected_targets(msg.roles, view.replicas, msg.ranks):
                entries.setdefault(
                    (msg.session_id, role, rank),
                    {
                        "id": msg.session_id,
                        "role": role,
                        "rank": rank,
                        "first_step": msg.first_step,
                        "last_step": msg.last_step,
                        "tool": msg.tool,
                        "path": "",
                        "bytes": 0,
                        "status": "scheduled",
                        "request_id": msg.request_id,
                    },
                )
    for msg in seen:
        if isinstance(msg, ProfileStarted):
            entry = entries.get((msg.session_id, msg.role, msg.rank))
            if entry is not None and entry["status"] == "scheduled":
                entry["status"] = "running"
        elif isinstance(msg, ProfileStopped):
            key = (msg.session_id, msg.role, msg.rank)
            entry = entries.setdefault(
                key, {"id": msg.session_id, "role": msg.role, "rank": msg.rank, "request_id": ""}
            )
            entry.update(
                first_step=msg.first_step,
                last_step=msg.last_step,
                tool=msg.tool,
                path=_relative_trace_path(msg.path),
                bytes=msg.bytes,
                status=msg.status or "ok",
                duration_s=msg.duration_s,
            )
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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return True
