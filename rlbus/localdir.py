"""``trainer.default_local_dir`` and ``trainer.resume_mode`` for ``rlbus up``: the same launch
line finds its run again, as verl's ``resume_mode=auto`` finds its checkpoints.

A run that starts with ``default_local_dir`` set writes :data:`runconfig.paths.RUN_MARKER`
there (``{"run_id": ...}``). A later ``rlbus up`` without ``run.id`` and with the same
folder takes that run's id (``resume_mode=auto``): from there on it is ``rlbus up
run.id=RUN`` (the run's log decides: continued, or already finished). ``resume_mode=disable``
starts a new run (a fresh id) that takes the folder over; the old run's checkpoints there
are never loaded (a trainer loads only what its own run's log names).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec

from runconfig import Config, ConfigError
from runconfig.paths import RUN_MARKER
from runconfig.schema import RunConfig
from storage.files import atomic_write

__all__ = ["mark_local_dir", "recorded_run", "run_from_local_dir"]

def _marker(cfg: Config) -> Path | None:
    local = cfg.trainer.default_local_dir
    return Path(local).expanduser() / RUN_MARKER if local else None


def recorded_run(cfg: Config) -> str | None:
    """The run id recorded in ``trainer.default_local_dir`` (None: no folder or no marker).
    An unreadable marker is a ConfigError naming the file."""
    path = _marker(cfg)
    if path is None or not path.is_file():
        return None
    try:
        run_id = json.loads(path.read_text())["run_id"]
        msgspec.convert({"id": run_id}, RunConfig)  # a string, with run.id's pattern
    except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError) as exc:
        raise ConfigError("trainer.default_local_dir", f"{path} does not name a run ({exc}); "
                          "remove it, or give run.id") from None
    return str(run_id)


def run_from_local_dir(cfg: Config, say: Callable[[str], None]) -> Config:
    """``cfg`` with ``run.id`` taken from ``trainer.default_local_dir`` when the line gives
    none and ``resume_mode=auto`` (unchanged otherwise; says what it found)."""
    found = recorded_run(cfg)
    if found is None or cfg.run.id == found:
        return cfg
    where = _marker(cfg)
    if cfg.run.id is not None:
        say(f"{where} names run {found}; run {cfg.run.id} (run.id) takes the folder over")
        return cfg
    if cfg.trainer.resume_mode == "disable":
        say(f"{where} names run {found}; trainer.resume_mode=disable: a new run")
        return cfg
    say(f"run {found}: found in {where} (trainer.resume_mode=auto)")
    return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, id=found))


def mark_local_dir(cfg: Config) -> None:
    """Record ``run.id`` in ``trainer.default_local_dir`` (created), when it is set."""
    path = _marker(cfg)
    if path is None or cfg.run.id is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps({"run_id": cfg.run.id}) + "\n").encode())
