"""The rollout context: everything a rollouter's loop over its tickets works with, and the
one interface both loops implement.

A loop (:class:`RolloutLoop`) is the built-in engine's :class:`~rollouter.batch.BatchRollout`
or a streaming engine's :class:`~rollouter.continuous.ContinuousRollout`. Each works on one
:class:`RolloutContext` and the engine; the context's parts each own their state:

- ``events``: the run's log, folded (:class:`~rollouter.events.EventPoller`: weights seen,
  the trainer's step boundaries, validation answers, the run's end);
- ``tickets``: the tickets read ahead, retried, answered (:class:`~rollouter.tickets.TicketDesk`);
- ``weights``: the weights held and the waits for those a ticket or a validation needs
  (:class:`~rollouter.weights.WeightsHolder` over :class:`~rollouter.weights.HeldWeights`);
- ``scorer``: responses decoded and scored (:class:`~rollouter.scoring.Scorer`);
- ``validations``: validation requests served (:class:`~rollouter.validation.ValidationServer`);
- ``trainer``: the trainer's presence (:class:`~rollouter.presence.Presence`);
- ``idle``: the share of time not spent generating (:class:`IdleMeter`).

The context is wired from its sources (where tickets come from, the log, the trainer's
lease, how weights are fetched and loaded, where events go): the rollouter's are the bus
(:mod:`rollouter.app`); a test's are in memory.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from agent.conversation import AgentLimits
from bus import RunKeys
from policy.text import TextTokenizer
from profiling.driver import StepProfiler
from rollouter.conversations import Conversations
from rollouter.engine import Engine, Off
from rollouter.events import EventLog, EventPoller
from rollouter.presence import Presence
from rollouter.scoring import Rewards, Scorer
from rollouter.tickets import TicketDesk, TicketSource
from rollouter.validation import ValidationServer
from rollouter.weights import HeldWeights, State, WeightsHolder
from runconfig import Config
from runschema.messages import PromptTicket, WarningRaised, WeightsPublished
from runtime.laps import Laps

__all__ = ["IdleMeter", "RolloutContext", "RolloutLoop"]

Publish = Callable[..., Awaitable[None]]
"""Append events to this replica's stream of the run's log (``Component.publish``)."""


class RolloutLoop(Protocol):
    """A replica's loop over its tickets until the run's end: every ticket answered once
    (samples published, then the ticket acked), retried, or dead-lettered."""

    async def run(self) -> None:
        """Serve tickets (and validation requests) until the run finishes."""
        ...

    def describe(self) -> str | None:
        """What the loop is doing, for the heartbeat's state (None: nothing to add)."""
        ...


ROLLOUT_LAPS = ("idle", "claim", "events", "weights", "generate", "score", "publish",
                "validate")
"""The rollout loop's laps (runtime.laps), per heartbeat window (``rollouter/timing_s/*``):

- ``idle``: waiting for tickets (the read ahead's, or a read; with none, reading the log,
  the trainer's presence, dead replicas' tickets);
- ``claim``: tickets accepted; ``events``: the log read;
- ``weights``: new weights fetched and loaded (with the continuous loop, validations
  served at a sync too);
- ``generate``: the engine generating; ``score``: the responses decoded (the built-in
  engine's loop; their rewards are computed in the background);
- ``publish``: waiting for the batch before to be scored and published (failed tickets
  retried), or, in the continuous loop, for the engine's finished answers to go out;
- ``validate``: serving validation requests between batches.
"""


class IdleMeter:
    """The share of time a replica spent neither generating nor validating, per window
    (one heartbeat to the next)."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.window_start = time.monotonic()

    def add(self, seconds: float) -> None:
        """``seconds`` of generation (or validation) in this window."""
        self.busy_s += seconds

    def take(self) -> float:
        """The idle share since the last call, and a new window from now."""
        now = time.monotonic()
        window = max(1e-6, now - self.window_start)
        idle = max(0.0, 1.0 - self.busy_s / window)
        self.busy_s, self.window_start = 0.0, now
        return idle


class RolloutContext:
    """Replica ``rank``'s parts, wired from its sources:

    ``source``: its tickets (its member of the rollouters' group); ``log``: the run's log;
    ``trainer``: the trainer's presence; ``fetch``: a publication's tensors (off the loop);
    ``load``: tensors into the engine as a version (on the worker); ``stranded``: a fetch
    nothing is bringing; ``find_dead``: the group's members whose replicas are dead;
    ``publish``: events into its stream of the log; ``complain``: a line on its stderr;
    ``commands`` / ``profiler``: its profiler agent's commands and the agent (profiling
    steps); ``off``: its worker thread; ``rewards``: the reward scoring (default: a
    :class:`~rollouter.scoring.RewardPool` of ``cfg``)."""

    def __init__(self, cfg: Config, *, rank: int, keys: RunKeys, tokenizer: TextTokenizer,
                 generator: torch.Generator, off: Off, source: TicketSource, log: EventLog,
                 trainer: Presence, fetch: Callable[[WeightsPublished], Awaitable[State]],
                 load: Callable[[State, int], Awaitable[object]],
                 stranded: Callable[[WeightsPublished], bool],
                 find_dead: Callable[[], Awaitable[list[str]]], publish: Publish,
                 complain: Callable[[str], None], commands: Callable[[], Awaitable[None]],
                 profiler: Callable[[], StepProfiler | None],
                 rewards: Rewards | None = None) -> None:
        rc = cfg.rollout
        self.cfg, self.rank, self.name = cfg, rank, f"rollouter{rank}"
        self.tokenizer, self.generator, self.off = tokenizer, generator, off
        self.publish, self.complain = publish, complain
        self.trainer = trainer
        self.idle = IdleMeter()
        self.laps = Laps(ROLLOUT_LAPS, prefix="rollouter/timing_s/", total="window")
        """What the rollout loop did, lap by lap; the heartbeat takes each window."""
        held = HeldWeights(self.name, fetch=fetch, load=load, warn=publish,
                           reread=lambda: self.events.poll(), stranded=stranded)
        self.events = EventPoller(log, saw_weights=held.saw,
                                  total_steps=cfg.trainer.total_training_steps,
                                  profiler=profiler, commands=commands, publish=publish,
                                  complain=complain, stream=keys.events)
        self.tickets = TicketDesk(source, keys.samples, rank=rank, batch=rc.prompts_per_batch,
                                  poll=self.events.poll, publish=publish,
                                  validates=bool(cfg.data.val_files), find_dead=find_dead)
        self.weights = WeightsHolder(held, events=self.events, trainer=trainer,
                                     tickets=self.tickets, timeout_s=rc.weights_fetch_timeout_s)
        self.scorer = Scorer(cfg, tokenizer, off=off, warn=self.warn, rewards=rewards)
        self.conversations: Conversations | None = None
        """The multi-turn side (rollout.multi_turn.enable): set by the rollouter's setup."""
        self.validations = ValidationServer(
            cfg, rank=rank, tickets=self.tickets, source=source, answers=keys.log("rollouter"),
            events=self.events, weights=self.weights, scorer=self.scorer, tokenizer=tokenizer,
            off=off, busy=self.idle.add, complain=complain)

    @property
    def agent_limits(self) -> AgentLimits | None:
        """The bounds a conversation's sample is cut to (None: no conversations)."""
        return None if self.conversations is None else self.conversations.limits

    @property
    def finished(self) -> bool:
        """The trainer finished the run (read from the log)."""
        return self.events.finished

    def prompt_ids(self, ticket: PromptTicket) -> list[int]:
        """The ticket's prompt as token ids: verl data carry theirs (chat template applied,
        truncated), used as given; a text prompt is encoded."""
        if ticket.prompt_ids is not None:
            return list(ticket.prompt_ids)
        return self.tokenizer.encode(ticket.prompt, bos=True)

    def eos_ids(self, engine: Engine) -> list[int]:
        """A response ends at the tokenizer's eos or any the model's generation_config lists."""
        return [i for i in (self.tokenizer.eos_id, *engine.eos_ids) if i is not None]

    async def warn(self, code: str, text: str) -> None:
        """Say ``text`` on stderr and publish it as a WarningRaised of ``code``."""
        self.complain(text)
        await self.publish(WarningRaised(source=self.name, code=code, message=text))

    async def stop(self) -> None:
        """The read ahead, the publication in flight and the staged weights, then the step
        watcher between two moves."""
        await self.tickets.stop()
        await self.weights.held.cancel()
        await self.events.stop()
