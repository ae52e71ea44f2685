"""A trainer step's wall time, accounted lap by lap (``timing_s/*`` of StepFinished).

The trainer's event loop runs its steps back to back. :func:`step_clock`
(:class:`runtime.laps.Laps` over :data:`PHASES`) cuts that time into *windows*, one per
step: step k's window runs from the moment step k-1's StepFinished was made to the moment
step k's is, so the windows tile the run (their sum is the run's wall time, start-up to the
last step) and ``timing_s/step`` is one window. The shell laps after each thing it does,
naming it; the laps add up to the window exactly. (The write of step k's own StepFinished
and what follows it, its tickets and retention, are the first laps of step k+1's window: a
message cannot carry the time of its own write.)

The names (seconds in the window):

- ``wait_samples``: blocked reading samples while the worker had nothing to compute
  (``trainer/idle_ratio`` x the step). verl's fully-async trainer calls this wait
  ``timing_s/gen``; rlbus's ``timing_s/gen`` is the rollouters' generation (trainer.metrics).
- ``read_samples``: reading and decoding samples while the worker computes beside it.
- ``read_claims``: reading the ticket claims stated before the samples (trainer.claims).
- ``read_peers``: reading the rollouters' liveness and their expired tickets' holders.
- ``judge``: the step core's decisions (checking samples, grouping, the mini-batches).
- ``acknowledge``: acks and dead letters of the samples consumer.
- ``wait_update``: waiting for the worker to finish the step's update after its last group.
- ``update_weights``: verl's name: publishing the weights (waiting for their
  serialisation on the worker, then the publication).
- ``save_checkpoint``: verl's name: the checkpoint (and resume point) write.
- ``write_step``: writing the previous step's StepFinished (fenced, acking its samples).
- ``write_events``: other events of the trainer (warnings, validation requests, tickets
  claimed back).
- ``issue_tickets``: writing the next steps' tickets.
- ``retention``: trimming what a checkpoint made redundant.
- ``commands``: reading and applying control commands, the step barrier.
- ``profiler``: a profiled step's start and stop.

Beside the window (not part of the sum): ``timing_s/update_actor`` is the worker's compute
for the step's update (verl's name; it runs under ``read_samples`` and ``wait_update``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runtime.laps import Laps

__all__ = ["PHASES", "step_clock"]

PHASES = ("wait_samples", "read_samples", "read_claims", "read_peers", "judge", "acknowledge",
          "wait_update", "update_weights", "save_checkpoint", "write_step", "write_events",
          "issue_tickets", "retention", "commands", "profiler")
"""Every lap's name (see the module docstring)."""


def step_clock(clock: Callable[[], float] = time.perf_counter) -> Laps:
    """The trainer's step window: ``timing_s/<phase>`` and ``timing_s/step``."""
    return Laps(PHASES, prefix="timing_s/", total="step", clock=clock)
