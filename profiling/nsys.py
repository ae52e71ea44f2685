"""The ``nsys profile`` command line for a component whose capture ranges rlbus opens.

With ``global_profiler.tool=nsys`` the agent calls ``cudaProfilerStart``/``Stop`` at step
boundaries (one range per session, or per step with ``global_tool_config.nsys.discrete``)
and marks each step with an NVTX range ``step:K``. nsys records only inside those ranges when
the process runs under ``nsys profile --capture-range=cudaProfilerApi``;
:func:`nsys_command` builds that prefix from ``worker_nsight_options`` (verl's key). Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from profiling.paths import profile_root, safe_name
from runconfig.schema import Config

__all__ = ["NSYS_CAPTURE_RANGE", "nsys_command"]

NSYS_CAPTURE_RANGE = "cudaProfilerApi"
"""The only capture range that works here: rlbus opens the ranges itself."""


def _flag(name: str, value: object) -> str | None:
    if value is None:
        return None  # null: leave nsys's default
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"--{name}={value}"


def nsys_command(cfg: Config, role: str, rank: int, run_id: str | None = None) -> list[str]:
    """``nsys profile [options] --output=save_path/RUN/{role}{rank}-%p``, to put before
    ``python -m trainer|rollouter ...``.

    Options come from ``global_profiler.global_tool_config.nsys.worker_nsight_options``
    (null values are left out); ``capture-range`` is always ``cudaProfilerApi``. With
    ``capture-range-end: repeat`` (the default) each range becomes its own report, numbered
    by nsys.
    """
    options = dict(cfg.global_profiler.global_tool_config.nsys.worker_nsight_options)
    options["capture-range"] = NSYS_CAPTURE_RANGE
    out = Path(profile_root(cfg, run_id)).resolve() / f"{safe_name(role, 32)}{int(rank)}-%p"
    flags = [f for f in (_flag(k, v) for k, v in options.items()) if f is not None]
    return ["nsys", "profile", *flags, f"--output={out}"]
