"""Where traces go: the run's profile folder and safe file names inside it.

Session ids and roles arrive over the network (the control stream), so every name built from
them is reduced to ``[A-Za-z0-9_.-]``, bounded in length, and checked to land inside the run's
folder. Commands never carry paths (design: "Commands never carry shell commands or paths
outside ``global_profiler.save_path``").
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

from runconfig.schema import Config

__all__ = [
    "MAX_NAME_LEN",
    "SESSIONS_DIR",
    "profile_root",
    "safe_name",
    "session_view_path",
    "trace_path",
    "trace_rank",
    "trace_world_size",
]

MAX_NAME_LEN = 64
"""Longest sanitised name component (a session id or role) used in a file name."""

SESSIONS_DIR = "sessions"
"""``run_dir/sessions/SESSION/``: one link per process of that session (see
:func:`session_view_path`)."""

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


def trace_rank(role: str, rank: int, trainers: int = 1) -> int:
    """The rank a trace carries in ``distributedInfo``: distinct per role and replica.

    Trainer rank ``t`` is ``t`` and rollouter replica ``r`` is ``trainers + r`` (``trainers``:
    the trainer's ranks, trainer.nnodes x n_gpus_per_node), so the traces of one session (every
    trainer rank and every rollouter) are ranks ``0..trainers + replicas - 1`` of one job for
    tools such as Holistic Trace Analysis. Another role gets ``rank`` unchanged.
    """
    if role == "trainer":
        return int(rank)
    if role == "rollouter":
        return int(trainers) + int(rank)
    return int(rank)


def trace_world_size(replicas: int, trace_rank: int = 0, ranks: Iterable[int] = (),
                     trainers: int = 1) -> int:
    """The ``world_size`` a trace carries in ``distributedInfo``: always above its rank.

    The trainer's ``trainers`` ranks plus ``replicas`` rollouters (``trainers +
    rollout.replicas``), widened to hold this trace's own rank (``trace_rank + 1``) and every
    rollouter the session names (``ranks``: its StartProfile's, i.e. ``global_profiler.ranks``;
    rollouter ``r`` is trace rank ``trainers + r``). A rollouter that joined a running run
    takes a rank at or above ``replicas`` (``rollout.rank`` null: the lowest free one), and
    tools that read several traces as one job (Holistic Trace Analysis) reject or misplace a
    rank not below its world size. Every process of a session that names the joined ranks
    computes the same value.
    """
    named = max((int(trainers) + 1 + int(r) for r in ranks), default=0)
    return max(int(trainers) + int(replicas), int(trace_rank) + 1, named)


def session_view_path(run_dir: Path, session_id: str, role: str, rank: int) -> Path:
    """``run_dir/sessions/{session_id}/{role}{rank}.json.gz``: the session's folder.

    Such a folder holds one trace per process of one session, each with its own
    ``distributedInfo.rank``, and nothing else: the folder that tools taking "a directory of
    one trace per rank" (Holistic Trace Analysis) load. ``run_dir`` itself also holds
    ``manifest.json`` and every session's traces, so it is not such a folder.
    """
    folder = run_dir / SESSIONS_DIR / safe_name(session_id)
    path = folder / f"{safe_name(role, 32)}{int(rank)}.json.gz"
    if path.resolve().parent.parent != (run_dir / SESSIONS_DIR).resolve():
        raise ValueError(f"session view {path} escapes {run_dir}")
    return path
