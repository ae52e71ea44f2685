"""Every component checks the run's storage (``run.storage``) at start: it can be read, and
by the trainer (which writes checkpoints, weights and the events archive) written. A storage
that cannot be used is one line naming ``run.storage``, the URL and the reason, and exit 2,
before anything starts (never a traceback mid-run)."""

from __future__ import annotations

from runconfig.paths import storage_url
from runconfig.schema import Config
from storage.run_storage import RunStorage, StorageError

__all__ = ["WRITERS", "check_storage"]

WRITERS = frozenset({"trainer", "up"})
"""Roles that write to the storage (probed with a small file written and deleted)."""


def check_storage(cfg: Config, role: str) -> str | None:
    """Why ``role`` cannot use the run's storage (one line), or None. Blocking (a probe of
    a remote storage goes over the network): call it before the event loop starts, or on a
    worker thread."""
    url = storage_url(cfg)
    key = "run.storage" if cfg.run.storage else "run.storage (null: run.output_dir)"
    write = role in WRITERS
    places = [(key, url)]
    if write and cfg.trainer.default_local_dir:  # the checkpoints go there instead
        places.append(("trainer.default_local_dir", cfg.trainer.default_local_dir))
    for name, where in places:
        try:
            RunStorage(where).probe(write=write)
        except StorageError as exc:
            return f"{name}={where} cannot be {'written' if write else 'read'}: {exc.reason}"
    return None
