"""The environment of ``global_profiler.finish_hook_cmd``: rlbus's variables and verl's.

verl runs its finish hook on each selected rank with ``VERL_PROFILE_SAVE_PATH``,
``VERL_PROFILE_TOOL``, ``VERL_PROFILE_RANK``, ``VERL_PROFILE_PID``, ``VERL_PROFILE_ROLE`` and,
for nsys, ``VERL_PROFILE_RAY_NSIGHT_DIR``. rlbus runs it once per run, in the profiler
service, after the run's last session stopped; :func:`hook_env` gives the same names their
meaning there. Torch-free: the profiler service imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

from runconfig.schema import Config

__all__ = ["hook_env"]


def hook_env(
    cfg: Config,
    run_id: str,
    profile_dir: Path,
    manifest: Path,
    pid: int | None = None,
) -> dict[str, str]:
    """The variables the finish hook gets (to add to ``os.environ``).

    * ``RLBUS_RUN_ID``, ``RLBUS_PROFILE_DIR`` (``save_path/RUN``, absolute),
      ``RLBUS_MANIFEST`` (its ``manifest.json``);
    * ``VERL_PROFILE_SAVE_PATH``: the folder holding every trace of the run (the same as
      ``RLBUS_PROFILE_DIR``: rlbus keeps a run's traces under ``save_path/RUN``);
    * ``VERL_PROFILE_TOOL``: ``global_profiler.tool``;
    * ``VERL_PROFILE_RANK``: ``0`` (the hook runs once, in one process);
    * ``VERL_PROFILE_PID``: the pid of the process that runs it (the profiler service);
    * ``VERL_PROFILE_ROLE``: ``profiler``;
    * ``VERL_PROFILE_RAY_NSIGHT_DIR`` (tool ``nsys`` only): where
      :func:`profiling.nsys.nsys_command` writes the nsys reports, the same folder.
    """
    folder = str(Path(profile_dir).resolve())
    env = {
        "RLBUS_RUN_ID": run_id,
        "RLBUS_PROFILE_DIR": folder,
        "RLBUS_MANIFEST": str(Path(manifest).resolve()),
        "VERL_PROFILE_SAVE_PATH": folder,
        "VERL_PROFILE_TOOL": cfg.global_profiler.tool or "",
        "VERL_PROFILE_RANK": "0",
        "VERL_PROFILE_PID": str(os.getpid() if pid is None else pid),
        "VERL_PROFILE_ROLE": "profiler",
    }
    if cfg.global_profiler.tool == "nsys":
        env["VERL_PROFILE_RAY_NSIGHT_DIR"] = folder
    return env
