"""Where a run's files go, derived from its config alone (every component agrees).

``run.storage`` is the run's storage: a local path or an fsspec URL (``s3://bucket/runs``,
``gs://...``, ``file:///shared/runs``); null means ``run.output_dir`` (the layout of a run on
one machine). The run's files live under ``STORAGE/RUN/``: ``checkpoints/``, ``events/`` (the
archive of the trimmed events log) and ``blobs/`` (weight files of the storage transport).
Checkpoints and the events archive are files a process opens locally: on a remote storage
they stay under ``run.output_dir/RUN/`` (:func:`local_root`), while weights go to the storage
and the trainer copies its checkpoints and events archive there (trainer.mirror).

``trainer.default_local_dir`` (verl's key) is the checkpoint folder of one run, as in verl:
a fixed folder that a launch line names, so that the same line finds its run again
(``trainer.resume_mode=auto``, :data:`RUN_MARKER`). Null keeps rlbus's layout,
``STORAGE/RUN/checkpoints``.
"""

from __future__ import annotations

from pathlib import Path

from runconfig.schema import Config

__all__ = [
    "RUN_MARKER",
    "blob_root",
    "checkpoint_dir",
    "checkpoint_url",
    "events_dir",
    "events_url",
    "local_path",
    "local_root",
    "record_dir",
    "storage_root",
    "storage_url",
]

RUN_MARKER = "rlbus_run.json"
"""The file in ``trainer.default_local_dir`` naming the run whose checkpoints it holds."""


def storage_url(cfg: Config) -> str:
    """The run storage as configured: ``run.storage``, or ``run.output_dir`` when null."""
    return cfg.run.storage or cfg.run.output_dir


def local_path(url: str) -> Path | None:
    """The local folder a storage URL names (a plain path or ``file://``), None for any
    other protocol."""
    if url.startswith("file://"):
        return Path(url[len("file://"):]).expanduser()
    if "://" in url or "::" in url:
        return None
    return Path(url).expanduser()


def _join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def storage_root(cfg: Config, run_id: str) -> str:
    """Run ``run_id``'s folder in the storage, as a URL (or a plain path)."""
    return _join(storage_url(cfg), run_id)


def local_root(cfg: Config, run_id: str) -> Path:
    """The run's local folder for the files a process opens on disk (checkpoints, events
    archive): the storage's when it is local, else ``run.output_dir/RUN``."""
    local = local_path(storage_url(cfg))
    return (local if local is not None else Path(cfg.run.output_dir)) / run_id


def checkpoint_dir(cfg: Config, run_id: str) -> Path:
    """The checkpoint folder of run ``run_id``: ``trainer.default_local_dir`` when set, else
    ``local_root/checkpoints``."""
    if cfg.trainer.default_local_dir:
        return Path(cfg.trainer.default_local_dir).expanduser()
    return local_root(cfg, run_id) / "checkpoints"


def checkpoint_url(cfg: Config, run_id: str) -> str:
    """:func:`checkpoint_dir` as a string (what a message names)."""
    return str(checkpoint_dir(cfg, run_id))


def events_dir(cfg: Config, run_id: str) -> Path:
    """The run's events archive folder: ``local_root/events``."""
    return local_root(cfg, run_id) / "events"


def record_dir(cfg: Config, run_id: str) -> Path:
    """The run's record folder (``run.record``, trainer.record): ``local_root/record``."""
    return local_root(cfg, run_id) / "record"


def events_url(cfg: Config, run_id: str) -> str:
    """:func:`events_dir` as a string (what a message names)."""
    return str(events_dir(cfg, run_id))


def blob_root(cfg: Config, run_id: str) -> str | Path:
    """The weight transport's root: ``STORAGE/RUN/blobs`` (a Path when the storage is local,
    else an fsspec URL)."""
    local = local_path(storage_url(cfg))
    if local is not None:
        return local / run_id / "blobs"
    return _join(storage_root(cfg, run_id), "blobs")
