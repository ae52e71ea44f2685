"""Where traces go: the run's profile folder and safe file names inside it.

Session ids and roles arrive over the network (the control stream), so every name built from
them is reduced to ``[A-Za-z0-9_.-]``, bounded in length, and checked to land inside the run's
folder. Commands never carry paths (design: "Commands never carry shell commands or paths
outside ``global_profiler.save_path``").
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from runconfig.schema import Config

__all__ = ["MAX_NAME_LEN", "profile_root", "safe_name", "trace_path"]

MAX_NAME_LEN = 64
"""Longest sanitised name component (a session id or role) used in a file name."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_DOTS = re.compile(r"\.{2,}")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # same rule as RunConfig.id


def profile_root(cfg: Config, run_id: str | None = None) -> Path:
    """``global_profiler.save_path/RUN_ID`` (``run.output_dir/profiles/RUN_ID`` by default).

    ``run_id`` overrides ``cfg.run.id`` (a launcher may generate the id after loading the
    config). Nothing is created on disk.
    """
    rid = run_id if run_id is not None else cfg.run.id
    if rid is None:
        raise ValueError("profile_root needs a run id (run.id is not set)")
    if not _RUN_ID.match(rid):
        raise ValueError(f"invalid run id {rid!r}")
    save = cfg.global_profiler.save_path
    base = Path(save) if save is not None else Path(cfg.run.output_dir) / "profiles"
    return base / rid


def safe_name(raw: str, max_len: int = MAX_NAME_LEN) -> str:
    """``raw`` reduced to a harmless file-name component.

    Unchanged when already safe; otherwise the cleaned text plus a short hash of ``raw``, so
    two different ids never collapse into one file name.
    """
    clean = _DOTS.sub("_", _UNSAFE.sub("_", raw)).lstrip(".")
    if clean == raw and 0 < len(clean) <= max_len:
        return clean
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    head = clean[: max(0, max_len - len(digest) - 1)]
    return f"{head}-{digest}" if head else digest


def trace_path(run_dir: Path, role: str, rank: int, session_id: str, suffix: str) -> Path:
    """``run_dir/{role}{rank}-{session_id}{suffix}`` with sanitised parts, inside ``run_dir``."""
    if not re.fullmatch(r"[A-Za-z0-9_.]{1,16}", suffix):  # our own constants, but be strict
        raise ValueError(f"invalid suffix {suffix!r}")
    name = f"{safe_name(role, 32)}{int(rank)}-{safe_name(session_id)}{suffix}"
    path = run_dir / name
    # Belt and braces: the sanitised name cannot escape, but a future change might.
    if path.resolve().parent != run_dir.resolve():
        raise ValueError(f"trace path {path} escapes {run_dir}")
    return path
