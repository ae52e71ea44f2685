"""The trainer's own resume points: what keeps the streams bounded when the user checkpoints
rarely or never (verl's default ``trainer.save_freq=-1``).

Retention (``run.retention=checkpoint``) trims samples, tickets and events only below a
durable checkpoint: a run without checkpoints would keep every sample in Redis (16 576 at
step 64 of the demo task; hundreds of GB over a week of a 7B job, until ``noeviction``
refuses every write). So the trainer writes a checkpoint of its own, a *resume point*, when
``run.resume_point_steps`` steps or ``run.resume_point_mb`` MB of trained samples have
gone by since the last checkpoint of either kind. A resume point is a checkpoint like any
other (``step-K.pt`` and its snapshot, CheckpointSaved with ``resume_point=true``, a resume
loads it) but no user checkpoint: no Hugging Face export, not counted in
``trainer.max_actor_ckpt_to_keep``, and deleted by retention once two newer checkpoints
exist (trainer.retention).

It is written only after a weight sync (a step that ends a ``trigger_parameter_sync_step``
window), where a resume can check the model it loads against the weights it published.

A resume that found the newest checkpoint corrupt or missing and loaded an older one writes
a resume point at its first sync, whatever the interval: otherwise retention, counting the
bad file as the newest checkpoint, would delete the intact one it fell back to once the next
checkpoint is written, and one more bad file would leave the run with none that serves.

Pure: no I/O; the step core asks it at each step's end.
"""

from __future__ import annotations

from collections.abc import Iterable

from runconfig import Config
from runschema.messages import Sample

__all__ = ["ResumePoints", "sample_bytes"]

MB = 1024 * 1024


def sample_bytes(samples: Iterable[Sample]) -> int:
    """About what ``samples`` hold in Redis: their token and log-prob arrays (the rest of
    an entry is a few hundred bytes)."""
    return sum(len(s.prompt_tokens.data) + len(s.response_tokens.data) + len(s.logprobs.data)
               for s in samples)


class ResumePoints:
    """When the next resume point is due, from the steps and the sample bytes trained since
    the last checkpoint of either kind."""

    def __init__(self, cfg: Config, steps: int = 0, *, fell_back: bool = False) -> None:
        rc = cfg.run
        self.on = rc.retention == "checkpoint"
        self.every_steps = rc.resume_point_steps
        self.every_bytes = int(rc.resume_point_mb * MB)
        self.steps = steps
        """Steps since the last checkpoint (a resume: those the log finished after it)."""
        self.bytes = 0
        """Bytes of samples trained since then (a resume counts from 0: an undercount by
        at most one interval)."""
        self.fell_back = fell_back
        """The resume loaded an older checkpoint than the newest the log names: one is due
        at the first sync."""

    def due(self, *, saved: bool, sync: bool, trained: int) -> bool:
        """After a step that trained ``trained`` bytes of samples: whether it writes a resume
        point (``saved``: a user checkpoint is written anyway; ``sync``: the step ended a
        weights window). Counts restart at every checkpoint."""
        self.steps += 1
        self.bytes += trained
        if saved:
            self.steps = self.bytes = 0
            self.fell_back = False
            return False
        over = self.fell_back or (self.every_steps > 0 and self.steps >= self.every_steps) or (
            self.every_bytes > 0 and self.bytes >= self.every_bytes)
        if not (self.on and sync and over):
            return False
        self.steps = self.bytes = 0
        self.fell_back = False
        return True
