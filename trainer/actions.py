"""The step core's interface: what the shell read (in) and what the core asks of it (out).

The trainer's step is a core that decides and a shell that reads and writes
(docs/architecture.md, "The trainer: a core and a shell"). The shell hands
:class:`trainer.core.StepCore` what it read as :class:`Reads` (and, for an idle turn, the
:class:`Holders` of the tickets :class:`Due` asked about); the core answers with actions, in
the order the shell must carry them out:

- :class:`Publish`: events to the trainer's log (``Writer.publish``: one fenced script, folded);
- :class:`Warn`: one warning to publish, said on stderr first when ``say``;
- :class:`IssueTickets`: prompt tickets and the ``TicketsIssued`` that records them, in one
  fenced script; the shell tells the core their entry ids (``StepCore.tickets_written``);
- :class:`DeadLetter`, :class:`Ack`: the samples entries of one read refused, each with its
  reason, or acked and dropped (through the fenced samples consumer, one round trip each:
  a flood of junk costs a script per read, not per entry);
- :class:`Train`: a mini-batch to hand to the worker (``optimize``: its first-epoch optimizer
  step may run now);
- :class:`RequestValidation`: a ``ValidationRequested`` into the prompts stream;
- :class:`ProfileStep`: the profiler's step boundary (``begin`` or end), when profiling is on;
- :class:`FinishStep`: ``StepFinished`` with the acks of the samples it trained, in one
  fenced script;
- :class:`Trim`: after a durable checkpoint (``run.retention=checkpoint``), the streams
  trimmed (trainer.retention), the step's trained entries and the live rollouters given.

Nothing here does anything: these are values, so the core is tested by comparing them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from bus import Delivery, Refusal
from runschema.messages import (
    ComponentFailed,
    Event,
    Heartbeat,
    PromptTicket,
    RolloutFailed,
    Sample,
    StepFinished,
    TicketsClaimed,
    TicketsIssued,
    ValidationFinished,
    ValidationRequested,
    WarningRaised,
)

__all__ = ["Ack", "Action", "Closing", "DeadLetter", "Due", "FinishStep", "Holders",
           "IssueTickets", "Measured", "ProfileStep", "Publish", "Reads", "RequestValidation",
           "Train", "Trim", "Warn"]


# ---------------------------------------------------------------------------- in


class Holders(NamedTuple):
    """Who holds the expired tickets :class:`Due` named: of their prompt entries, those
    still in the prompts stream (``present``), and the consumer each pending entry of the
    rollouters' group is delivered to (``owners``)."""

    tickets: Sequence[int]
    present: Collection[str] = ()
    owners: Mapping[str, str] = {}


class Reads(NamedTuple):
    """What the shell read in one turn, at ``now`` (its monotonic clock, seconds).

    ``deliveries``: a read of the samples stream; ``dead_tickets``: tickets the rollouters
    dead-lettered; ``lost_samples``: answers dead-lettered from the trainer's group;
    ``failures``: RolloutFailed events; ``validated``: ValidationFinished events;
    ``peers``: the heartbeats of the rollouters alive now (None: not read this turn);
    ``idle``: the samples stream had nothing for the trainer, so the run's health is judged
    (with ``peers`` and ``holders`` as :meth:`trainer.core.StepCore.due` asked);
    ``claims``: the rollouters' claims of tickets stated since the last turn, read after
    ``deliveries`` (so every claim an answer of them follows is here: trainer.claims);
    ``refused``: entries of the read the consumer dead-lettered itself (undecodable), which
    the core never sees but counts for the size of the next read
    (:attr:`trainer.core.StepCore.read_size`); ``peer_failed``: the rollouters'
    ComponentFailed events (their stated causes, which a "no rollouter is alive" repeats)."""

    now: float
    deliveries: Sequence[Delivery] = ()
    dead_tickets: Sequence[PromptTicket] = ()
    lost_samples: Sequence[Sample] = ()
    failures: Sequence[RolloutFailed] = ()
    validated: Sequence[ValidationFinished] = ()
    peers: Sequence[Heartbeat] | None = None
    holders: Holders | None = None
    idle: bool = False
    claims: Sequence[TicketsClaimed] = ()
    refused: int = 0
    peer_failed: Sequence[ComponentFailed] = ()


class Due(NamedTuple):
    """What the shell reads before an idle turn: the rollouters' heartbeats (``peers``: a
    heartbeat interval passed since the last read, or a ticket's lease expired), and for
    the ``expired`` tickets the holders of their prompt ``entries`` (up to ``owners``
    pending entries of the rollouters' group)."""

    peers: bool
    expired: list[int]
    entries: list[str]
    owners: int


class Measured(NamedTuple):
    """What the shell measured of a step, by clocks the core does not read: seconds waiting
    for samples with nothing to compute, the worker's compute time, the event loop's CPU
    since the previous step; and the trainer ranks that trained it."""

    wait_s: float
    update_s: float
    loop_cpu_s: float
    ranks: int
    laps: Mapping[str, float] = {}
    """The step window's wall time by what the shell did (trainer.timing)."""
    memory: Mapping[str, float] = {}
    """verl's ``perf/*memory*`` figures at the step's end (trainer.learner.memory_metrics)."""


# ---------------------------------------------------------------------------- out


class Publish(NamedTuple):
    events: list[Event]


class Warn(NamedTuple):
    warning: WarningRaised
    say: bool = False


class IssueTickets(NamedTuple):
    tickets: list[PromptTicket]
    event: TicketsIssued


class DeadLetter(NamedTuple):
    refusals: list[Refusal]


class Ack(NamedTuple):
    entry_ids: list[str]


class Train(NamedTuple):
    groups: list[list[Sample]]
    optimize: bool


class RequestValidation(NamedTuple):
    request: ValidationRequested


class ProfileStep(NamedTuple):
    step: int
    begin: bool


class FinishStep(NamedTuple):
    finished: StepFinished


class Trim(NamedTuple):
    entry_ids: list[str]
    rollouter_ranks: list[int]


Action = (Publish | Warn | IssueTickets | DeadLetter | Ack | Train | RequestValidation
          | ProfileStep | FinishStep | Trim)


class Closing(NamedTuple):
    """A step whose groups are all trained, closed: ``sync``: the weights version went up
    (publish them); ``save``: a checkpoint is due; ``early``: the next step's ready
    mini-batches, begun now on the worker (None: the boundary stays serial, a profiled or
    checkpoint step)."""

    sync: bool
    save: bool
    early: list[Train] | None
    resume_point: bool = False
    """The trainer's own checkpoint is due (trainer.resumepoints): written like ``save``'s,
    without what only a user checkpoint has."""
