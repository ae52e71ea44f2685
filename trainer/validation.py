"""Validation requests: when the trainer asks for a validation, and how it asks.

verl's rule (its fully-async trainer), in parameter versions (one per weight sync, every
``async_training.trigger_parameter_sync_step`` updates), never in updates: with
``data.val_files`` set, ``trainer.val_before_train`` validates version 0 (the initial
weights), and ``trainer.test_freq > 0`` validates every version that is a multiple of it and
the run's last version; ``trainer.val_only`` validates the one version the run publishes
(its initial weights, or a fork's) and trains nothing. A request is a
``ValidationRequested(request_id="val-v{v}")`` entry in the prompts stream, written through
the trainer's fenced writer right after the weights it names were published: one rollouter
serves it between its batches and publishes ``ValidationFinished`` to the events log.
Training never waits for it; only the end of the run does (trainer.app, before RunFinished),
so the last version's figures are in the log when the run finishes; that wait is judged as a
step's is (a stall said naming the requests, a failure past ``heartbeat.stall_timeout_s``:
trainer.core).

A version is validated once in a run, whatever the trainer's restarts: a resumed trainer
starts from every answer already in the log (:meth:`Validations.start`) and never asks again
for one of them (no rollouter would answer it twice: rollouter.validation), and it asks again
for its current version's validation when that was asked and not answered (the copies are
one request: the first answer wins).

The step core (trainer.core) decides the requests (:class:`ValidationRequests`) and takes the
answers it is handed; :class:`Validations` writes the requests and reads the answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from bus import Bus, Entry, RunKeys
from runconfig import Config
from runschema.messages import ValidationFinished, ValidationRequested
from runtime import LogFollower

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
    if cfg.trainer.val_only:  # the one version it publishes is what the run is for
        return True
    if version == 0:
        return cfg.trainer.val_before_train or (cfg.trainer.test_freq > 0 and last)
    freq = cfg.trainer.test_freq
    return freq > 0 and (version % freq == 0 or last)


class ValidationRequests:
    """The validation requests the trainer made that no answer has come for yet (pure: the
    step core holds it, trainer.core); ``answered``: the request ids the log already answered
    when this trainer started."""

    def __init__(self, cfg: Config, answered: Iterable[str] = ()) -> None:
        self.cfg = cfg
        self.pending: dict[str, ValidationRequested] = {}
        self.done: set[str] = set(answered)
        """The requests answered in the log: never asked again."""

    def due(self, version: int, step: int, last: bool) -> ValidationRequested | None:
        """Weights ``version`` were just published after ``step`` updates: the request of
        their validation when it is due (``last``: no later version will be published) and
        not answered already (a resumed trainer publishes the version it holds again)."""
        if not validation_due(version, self.cfg, last) or request_id(version) in self.done:
            return None
        msg = ValidationRequested(request_id=request_id(version), version=version, step=step)
        self.pending[msg.request_id] = msg
        return msg

    def answered(self, answers: Sequence[ValidationFinished]) -> bool:
        """Take ``answers``; whether one was of a pending request."""
        before = len(self.pending)
        for msg in answers:
            self.done.add(msg.request_id)
            self.pending.pop(msg.request_id, None)
        return len(self.pending) < before

    def waiting_for(self) -> str:
        """The answers the trainer waits for, in words."""
        asked = ", ".join(f"{m.request_id} (weights v{m.version}, asked after step {m.step})"
                          for m in sorted(self.pending.values(), key=lambda m: m.version))
        return f"the answer to validation request(s) {asked} from a rollouter"


class Validations:
    """The trainer's reads and writes of validations: its requests, written through
    ``writer``; the answers, read from the rollouters' stream of the log (taken by the
    shell into the core's reads), from its beginning on (:meth:`start`)."""

    def __init__(self, cfg: Config, bus: Bus, keys: RunKeys, writer: Writer) -> None:
        self.cfg = cfg
        self.keys = keys
        self.writer = writer
        self.answers: list[ValidationFinished] = []
        # The answers are the rollouters' facts: their own stream of the log (never trimmed).
        self.events = LogFollower(bus, keys, ("rollouter",), fold=self._fold)

    def _fold(self, entries: Sequence[Entry]) -> None:
        self.answers += [msg for _, msg in entries if isinstance(msg, ValidationFinished)]

    async def start(self) -> list[str]:
        """Before the run's first request: the request ids answered in the log so far (a
        resumed trainer asks none of them again). Read from the beginning of the rollouters'
        stream, then followed without a gap: an answer to a request made before this
        trainer started, written after that read, is read too. Nothing without
        ``data.val_files``."""
        if not self.cfg.data.val_files:
            return []
        await self.events.catch_up()
        return [msg.request_id for msg in self.take()]

    def take(self) -> list[ValidationFinished]:
        """The answers read since the last call."""
        answers, self.answers = self.answers, []
        return answers

    async def poll(self, block_ms: int) -> None:
        """Read new answers (waiting up to ``block_ms`` for one); :meth:`take` them."""
        await self.events.poll(block_ms=block_ms)

    async def request(self, msg: ValidationRequested) -> None:
        """Write a request (the core decided it is due)."""
        await self.events.catch_up()  # answers so far; keeps the position near the end
        await self.writer.write([(self.keys.prompts, msg)])
