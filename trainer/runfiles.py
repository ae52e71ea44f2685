"""The trainer's files of one run on this node: its checkpoint folder, its events archive,
and their copies on a remote ``run.storage`` (trainer.mirror).

At start, before the log is read, :meth:`RunFiles.fetch` brings what another node wrote;
:meth:`RunFiles.check_covered` then refuses to train from scratch inside a run whose steps
this storage cannot restore. Every blocking call goes to a thread.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from runconfig import Config
from runconfig.paths import checkpoint_dir, local_root
from trainer.mirror import checkpoint_mirror, events_mirror, record_mirror
from trainer.resume import LogRead, ResumeFailed, RunNotCovered, missing_checkpoint, not_covered

__all__ = ["RunFiles"]


class RunFiles:
    """Where run ``run_id``'s checkpoints and archived events lie here, and their mirrors."""

    def __init__(self, cfg: Config, run_id: str) -> None:
        self.run_id = run_id
        self.run_dir = local_root(cfg, run_id)  # run.storage when local (runconfig.paths)
        self.ckpt_dir = checkpoint_dir(cfg, run_id)  # trainer.default_local_dir
        # On a remote run.storage the local checkpoint folder is a cache of the storage's.
        self.mirror = checkpoint_mirror(cfg, run_id)
        self.events_mirror = events_mirror(cfg, run_id)  # its events archive too
        self.record_mirror = record_mirror(cfg, run_id)  # and its record (trainer.record)

    @property
    def events_dir(self) -> Path:
        """The local events archive (run.retention=checkpoint)."""
        return self.run_dir / "events"

    async def fetch(self) -> list[str]:
        """On a remote storage, the checkpoints and archived events this node lacks
        (another node wrote them); the lines to say about what came."""
        lines = []
        if self.mirror is not None:
            fetched = await asyncio.to_thread(self.mirror.download_missing)
            if fetched:
                lines.append(f"fetched {len(fetched)} checkpoint files from "
                             f"{self.mirror.where()} into {self.ckpt_dir}")
        for mirror, what in ((self.events_mirror, "events archive"),
                             (self.record_mirror, "record")):
            if mirror is None:
                continue
            segments = await asyncio.to_thread(mirror.fetch)
            if segments:
                lines.append(f"fetched {len(segments)} {what} segments from "
                             f"{mirror.where()} into {mirror.folder}")
        return lines

    def locate(self, path: str) -> str:
        """The local file of a checkpoint the log names (by its path on the node that
        wrote it; on a remote storage, the copy of that name here)."""
        return path if self.mirror is None else self.mirror.locate(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(self.locate(path))

    async def upload(self, saved: Path) -> None:
        """A checkpoint just written, into the remote storage (nothing on a local one):
        before the log names it."""
        if self.mirror is not None:
            await asyncio.to_thread(self.mirror.upload, saved)

    async def check_covered(self, read: LogRead) -> None:
        """Never train from scratch inside a run that has steps: steps of the log this
        storage cannot restore (no snapshot, no archive of the trimmed log) are a
        :class:`~trainer.resume.RunNotCovered` (exit 2, naming what is missing)."""
        why = not_covered(self.run_id, read, str(self.ckpt_dir), str(self.events_dir))
        if why is not None:
            raise RunNotCovered(why)
        # Checkpoints the log names, none of them here: a ResumeFailed (exit 1 and a
        # ComponentFailed, as rebuild would say it), before the model is built.
        why = await asyncio.to_thread(missing_checkpoint, self.run_id, read.state,
                                      self.exists)
        if why is not None:
            raise ResumeFailed(why)
