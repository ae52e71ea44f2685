"""The trainer's checkpoints: durable before the log names them, on the run's storage, their
Hugging Face directory exported beside them, and the log trimmed after one.

A checkpoint step (verl's ``save_freq``, in its units: runconfig.stepunit) writes the model,
the optimizer and the folded state on the worker (:func:`trainer.resume.write_checkpoint`),
uploads them to a remote ``run.storage``, starts the HF export (``hf_model`` in
``trainer.checkpoint_contents``: a thread of its own, trainer.export) and only then says
``CheckpointSaved``. With ``run.retention=checkpoint`` the streams are trimmed after the step
that made it (trainer.retention), off the step's critical path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from bus import Bus, Lease, RunKeys
from runconfig import Config
from runschema.messages import CheckpointSaved, Event, WarningRaised
from runtime.faults import disk_full, space_warning
from storage.record import RecordCorrupt
from trainer.export import HFExport, RunOff
from trainer.learner import Learner
from trainer.record import Recorder
from trainer.resume import write_checkpoint
from trainer.retention import trim_after_checkpoint
from trainer.runfiles import RunFiles
from trainer.weights import KEEP_WEIGHTS
from trainer.writer import Writer

__all__ = ["Checkpoints"]


class Checkpoints:
    """The checkpoints of one trainer incarnation, written through ``off`` (its worker)."""

    def __init__(self, cfg: Config, bus: Bus, keys: RunKeys, files: RunFiles, lease: Lease,
                 off: RunOff) -> None:
        self.cfg, self.bus, self.keys, self.files = cfg, bus, keys, files
        self.lease, self.off = lease, off
        tc = cfg.trainer
        self.hf_export = HFExport(cfg.model.path, files.mirror) if (
            "hf_model" in tc.checkpoint_contents and cfg.model.path) else None
        self.retaining: asyncio.Future[WarningRaised | None] | None = None
        """The retention running beside the steps (:meth:`trim_later`), one at a time."""
        self.recorder: Recorder | None = None
        """The run's record (run.record): samples are copied there before they are trimmed."""
        self.fallback: list[str] = []
        """The samples the step of the checkpoint before the newest trained: the samples
        stream is trimmed only below them."""

    async def save(self, step: int, learner: Learner, writer: Writer, *,
                   resume_point: bool = False,
                   warn: Callable[[WarningRaised], Awaitable[None]] | None = None,
                   ) -> tuple[Path, list[Event]]:
        """Model, optimizer and the folded state, durable (and in a remote storage) before
        the log says so; the HF directory written beside it while training goes on (not for
        a ``resume_point``: trainer.resumepoints). Returns the checkpoint file and the
        events to publish, ``CheckpointSaved`` last."""
        folder = self.files.ckpt_dir
        events: list[Event] = []
        what = f"the checkpoint of step {step}"
        short = await asyncio.to_thread(space_warning, folder,
                                        self._expected_size(writer, learner), what)
        if short is not None and warn is not None:  # now: the write may be what fails
            await warn(WarningRaised(source="trainer", code="checkpoint_space", message=short))
        try:
            saved, files = await self.off(write_checkpoint, folder, step, learner.version,
                                          learner.checkpoint_payload, writer.snapshot(),
                                          learner.shard_digests, resume_point=resume_point)
        except (OSError, RuntimeError) as exc:
            full = await asyncio.to_thread(disk_full, exc, folder, what)
            if full is None:
                raise
            raise full from exc
        await self.files.upload(saved)
        hf_path = None
        if self.hf_export is not None and not resume_point:
            target, warning = await self.hf_export.start(self.off, learner.module,
                                                         self.files.ckpt_dir, step,
                                                         learner.hf_state)
            hf_path = str(target)
            if warning is not None:
                events.append(warning)
        events.append(CheckpointSaved(step=step, path=str(saved),
                                      param_version=learner.version, hf_path=hf_path,
                                      files=files, resume_point=resume_point))
        return saved, events

    def _expected_size(self, writer: Writer, learner: Learner) -> int:
        """About how many bytes the next checkpoint takes: the last one's files (their
        digests record sizes), else the weights and two optimizer moments of each."""
        _, last = writer.state.checkpoint()
        if last is not None and (files := writer.state.files_of(last)):
            return sum(f.size for f in files.values())
        return 3 * sum(p.numel() * p.element_size() for p in learner.module.parameters())

    async def exported(self) -> WarningRaised | None:
        """Before RunFinished: the last checkpoint's HF directory is whole (or why not)."""
        return None if self.hf_export is None else await self.hf_export.wait()

    async def trim(self, trained: Sequence[str], *, last_step: int, current: str | None,
                   rollouter_ranks: Sequence[int]) -> WarningRaised | None:
        """Retention after a durable checkpoint (trainer.retention); the warning to
        publish when the events archive could not be written."""
        files = self.files
        # Samples are kept back to the checkpoint before this one: a resume that finds this
        # one corrupt falls back to that one and re-applies the steps after it
        # (trainer.resume). The first of an incarnation trims below the samples of the log's
        # newest checkpoint (set at start, trainer.process).
        below, self.fallback = self.fallback, list(trained)
        return await trim_after_checkpoint(
            self.bus, self.keys, files.run_dir, below, keep_weights=KEEP_WEIGHTS,
            checkpoints=files.ckpt_dir, mirror=files.mirror, events_mirror=files.events_mirror,
            keep_checkpoints=self.cfg.trainer.max_actor_ckpt_to_keep, last_step=last_step,
            current=current, fence=(self.keys.trainer_lease, self.lease.token),
            rollouter_ranks=rollouter_ranks, recorder=self.recorder)

    async def trim_later(self, trained: Sequence[str], *, last_step: int, current: str | None,
                         rollouter_ranks: Sequence[int]) -> WarningRaised | None:
        """Start :meth:`trim` beside the next steps: the run's record, the events archive
        and the trims are file work and Redis reads the steps need not wait for. One at a
        time: the previous one (a checkpoint window ago) is awaited first; its warning is
        returned."""
        warning = await self.retained()
        self.retaining = asyncio.ensure_future(self.trim(
            trained, last_step=last_step, current=current, rollouter_ranks=rollouter_ranks))
        return warning

    def collect(self) -> WarningRaised | None:
        """The warning of a retention that has finished (None: none, or still running); its
        failure is raised here, on the trainer's path."""
        if self.retaining is None or not self.retaining.done():
            return None
        task, self.retaining = self.retaining, None
        return task.result()

    async def retained(self) -> WarningRaised | None:
        """Wait for the retention running now (before the next one, and at the run's end);
        its warning."""
        if self.retaining is None:
            return None
        task, self.retaining = self.retaining, None
        return await task

    async def record_rest(self) -> WarningRaised | None:
        """At the run's end, before RunFinished: the samples not recorded yet go into the
        run's record (trainer.record), so that it holds the whole run; the warning to
        publish when it could not be written."""
        if self.recorder is None:
            return None
        try:
            await self.recorder.record_below(None)
        except (OSError, RecordCorrupt) as exc:
            return WarningRaised(source="trainer", code="record_not_written",
                                 message=f"the run's record misses its last samples: {exc}")
        return None

    def close(self) -> None:
        if self.retaining is not None:  # a trainer that stops: its trim is done again later
            self.retaining.cancel()
        if self.hf_export is not None:
            self.hf_export.close()
