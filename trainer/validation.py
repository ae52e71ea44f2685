"""Validation requests: when the trainer asks for a validation, and how it asks.

verl's rule (its fully-async trainer), in parameter versions (one per weight sync, every
``async_training.trigger_parameter_sync_step`` updates), never in updates: with
``data.val_files`` set, ``trainer.val_before_train`` validates version 0 (the initial
weights), and ``trainer.test_freq > 0`` validates every version that is a multiple of it and
the run's last version. A request is a ``ValidationRequested(request_id="val-v{v}")`` entry
in the prompts stream, written through the trainer's fenced writer right after the weights it
names were published: one rollouter serves it between its batches and publishes
``ValidationFinished`` to the events log. Training never waits for it; only the end of the
run does (:meth:`Validations.settle`, before RunFinished), so the last version's figures are
in the log when the run finishes.

The step core (trainer.core) decides the requests (:class:`ValidationRequests`) and takes the
answers it is handed; :class:`Validations` writes the requests and reads the answers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from bus import Bus, Entry, RunKeys
from runconfig import Config
from runschema.messages import ValidationFinished, ValidationRequested
from runtime import LogFollower, since

if TYPE_CHECKING:  # the writer imports torch (trainer.resume); the core imports this module
    from trainer.writer import Writer

__all__ = ["ValidationRequests", "Validations", "last_version", "request_id", "validation_due"]


def request_id(version: int) -> str:
    """The request id of weights ``version``'s validation (unique within a run)."""
    return f"val-v{version}"


def last_version(step: int, trigger: int, total: int) -> bool:
    """Whether weights published after ``step`` updates are the run's last: the next sync
    (every ``trigger`` updates) would come after update ``total``."""
    return (step // trigger + 1) * trigger > total


def validation_due(version: int, cfg: Config, last: bool) -> bool:
    """Whether publishing weights ``version`` asks for their validation (verl's rule, see the
    module docstring); ``last``: no later version will be published in this run."""
    if not cfg.data.val_files:
        return False
    if version == 0:
        return cfg.trainer.val_before_train or (cfg.trainer.test_freq > 0 and last)
    freq = cfg.trainer.test_freq
    return freq > 0 and (version % freq == 0 or last)


class ValidationRequests:
    """The validation requests the trainer made that no answer has come for yet (pure: the
    step core holds it, trainer.core)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.pending: set[str] = set()

    def due(self, version: int, step: int, last: bool) -> ValidationRequested | None:
        """Weights ``version`` were just published after ``step`` updates: the request of
        their validation when it is due (``last``: no later version will be published)."""
        if not validation_due(version, self.cfg, last):
            return None
        msg = ValidationRequested(request_id=request_id(version), version=version, step=step)
        self.pending.add(msg.request_id)
        return msg

    def answered(self, answers: Sequence[ValidationFinished]) -> None:
        for msg in answers:
            self.pending.discard(msg.request_id)


class Validations:
    """The trainer's reads and writes of validations: its requests, written through
    ``writer``; the answers, read from the rollouters' stream of the log (taken by the
    shell into the core's reads) and awaited at the run's end."""

    def __init__(self, cfg: Config, bus: Bus, keys: RunKeys, writer: Writer) -> None:
        self.cfg = cfg
        self.keys = keys
        self.writer = writer
        self.answers: list[ValidationFinished] = []
        # The answers are the rollouters' facts: their own stream of the log.
        self.events = LogFollower(bus, keys, ("rollouter",), fold=self._fold)
        self.started = False

    def _fold(self, entries: Sequence[Entry]) -> None:
        self.answers += [msg for _, msg in entries if isinstance(msg, ValidationFinished)]

    def take(self) -> list[ValidationFinished]:
        """The answers read since the last call."""
        answers, self.answers = self.answers, []
        return answers

    async def request(self, msg: ValidationRequested) -> None:
        """Write a request (the core decided it is due)."""
        if not self.started:
            # Answers come after the request: read the log from here on.
            self.events.start_at_end(
                dict.fromkeys(self.events.positions, since(self.writer.position)))
            self.started = True
        else:
            await self.events.catch_up()  # answers so far; keeps the position near the end
        await self.writer.write([(self.keys.prompts, msg)])

    async def settle(self, requests: ValidationRequests,
                     check: Callable[[], Awaitable[None]]) -> None:
        """At the run's end: wait for the answers of the ``requests`` still out, calling
        ``check`` (e.g. rollouters alive) between reads; a trainer fenced out stops at once.
        Gives up with a line on stderr after ``heartbeat.stall_timeout_s`` without an answer
        (the run still finishes)."""
        if not requests.pending:
            return
        bound = self.cfg.heartbeat.stall_timeout_s
        await self.events.catch_up()  # archive, then stream: trims may have passed us
        requests.answered(self.take())
        last_answer, left = time.monotonic(), len(requests.pending)
        while requests.pending:
            await self.events.poll(block_ms=500)
            requests.answered(self.take())
            if len(requests.pending) < left:
                last_answer, left = time.monotonic(), len(requests.pending)
            if time.monotonic() - last_answer > bound:
                print(f"trainer: warning: no answer to validation request(s) "
                      f"{', '.join(sorted(requests.pending))} within {bound:g} s "
                      "(heartbeat.stall_timeout_s); finishing without them",
                      file=sys.stderr, flush=True)
                return
            self.writer.check_fenced()
            await check()
