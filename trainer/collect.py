"""A step's groups, gathered from the samples stream and trained as they complete.

The trainer's inner loop (docs/architecture.md, "A step trains while it gathers"): read
samples, judge them (:class:`~trainer.intake.Intake`), apply the verdicts in order (dead
letter, ack, reissue, warning), hand each complete mini-batch to the worker
(:class:`~trainer.stepwork.StepWork`), and between reads take the reports (tickets given up,
answers dead-lettered) and check the run's health (peers, ticket leases, stalls).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bus import Consumer, Delivery
from bus.messages import WarningRaised
from runconfig import Config
from trainer.dispatch import Dispatch
from trainer.intake import Complete, Duplicate, Group, Intake, Refuse, Stale, Verdict
from trainer.learner import Learner
from trainer.metrics import StepMeter
from trainer.stepwork import StepWork, may_stream
from trainer.watch import Watch
from trainer.writer import Writer

__all__ = ["Collector"]


class Collector:
    """Gathers ``need`` groups per step (``require_batches * ppo_mini_batch_size``) through
    ``consumer``; ``submit`` queues a call on the trainer's worker, ``publish`` writes the
    trainer's events."""

    def __init__(self, cfg: Config, *, consumer: Consumer, writer: Writer, intake: Intake,
                 dispatch: Dispatch, watch: Watch, meter: StepMeter, learner: Learner,
                 submit: Callable[..., asyncio.Future[Any]],
                 publish: Callable[..., Awaitable[None]]) -> None:
        self.cfg = cfg
        self.consumer, self.writer, self.intake = consumer, writer, intake
        self.dispatch, self.watch, self.meter, self.learner = dispatch, watch, meter, learner
        self.submit, self.publish = submit, publish
        self.need = cfg.async_training.require_batches * cfg.trainer.ppo_mini_batch_size
        self.update_s = 0.0  # the worker's compute time in the last step

    def begin(self) -> StepWork:
        """A step's training, started: the mini-batches already complete go to the worker
        (behind whatever it has queued, e.g. the previous step's weights serialisation)."""
        work = StepWork(self.submit, self.learner.step())
        self._feed(work)
        return work

    def _feed(self, work: StepWork) -> None:
        ledger, version, intake = self.writer.state.ledger, self.learner.version, self.intake
        work.feed(intake.ready, self.need, self.cfg.trainer.ppo_mini_batch_size,
                  lambda missing: may_stream(intake.ready, missing, ledger.open, intake.taken,
                                             version))

    async def gather(self, work: StepWork | None) -> tuple[list[Group], dict[str, float]]:
        """Gather the step's groups and train on them as they come: the same computation as
        training on the whole batch at the end (trainer.update.grpo_update), which is what
        a resume replays."""
        work = work or self.begin()
        self.watch.last_progress = max(self.watch.last_progress, time.monotonic())
        self.meter.wait_s = 0.0
        try:
            while True:
                self._feed(work)
                if len(work.taken) >= self.need:
                    break
                self.writer.check_fenced()
                await self._take_reports()
                work.raise_failures()
                t_read = time.monotonic()
                deliveries = await self.consumer.read(count=256, block_ms=500)
                if not work.running:  # nothing to compute: the trainer waits for samples
                    self.meter.wait_s += time.monotonic() - t_read
                if deliveries:
                    self.watch.samples_arrived()
                    await self._take(deliveries)
                else:
                    # Only when the stream has nothing for us: answers that arrived during a
                    # long update are read before any lease is judged expired.
                    await self._check_health()
            metrics = await work.finish()
        finally:
            await work.settle()
        self.update_s = work.busy_s
        return work.taken, metrics

    async def _take_reports(self) -> None:
        """Tickets the rollouters gave up (their slots freed, new tickets issued) and answers
        that went to the dead-letter stream (their tickets reissued)."""
        version, taken = self.learner.version, self.intake.taken
        dead = self.watch.take_dead_tickets()
        if dead:
            for index in await self.dispatch.close_dead(dead, taken):
                self.intake.drop_partial(index)
            await self.dispatch.issue(version)
        lost = self.watch.take_lost_samples()
        if lost:
            await self.dispatch.reissue_lost(lost, version, taken)

    async def _take(self, deliveries: list[Delivery]) -> None:
        """Apply the intake's verdicts on one read, in order."""
        verdicts = self.intake.judge(deliveries, self.writer.state.ledger, self.learner.version,
                                     self.learner.vocab_size, self.learner.max_len)
        for verdict in verdicts:
            await self._apply(verdict)

    async def _apply(self, verdict: Verdict) -> None:
        version, taken = self.learner.version, self.intake.taken
        match verdict:
            case Refuse(delivery, reason, reissue):
                await self.consumer.dead_letter(delivery, reason)
                if reissue is not None:
                    await self.dispatch.reissue([reissue], "an answer was invalid", version, taken)
            case Duplicate(entry_ids):
                await self.consumer.ack(*entry_ids)
            case Stale(group, message):
                self.dispatch.answered(group.index, group.arrived)
                await self.consumer.ack(*group.entry_ids())
                await self.publish(WarningRaised(source="trainer", code="stale_group_discarded",
                                                 message=message))
                await self.dispatch.reissue([group.index], "answer too stale", version, taken)
            case Complete(group):
                self.dispatch.answered(group.index, group.arrived)
                self.watch.progressed()

    async def _check_health(self) -> None:
        """Peers alive, leases of unanswered tickets, progress (each raises or warns)."""
        await self.watch.check_peers()
        expired = self.dispatch.expired(self.intake.taken)
        if expired:
            live = await self.watch.read_peers()  # who is alive now, not at the last check
            await self.dispatch.reissue_expired(expired, live, self.learner.version,
                                                self.intake.taken)
        warning = await self.watch.check_stall(self._waiting_for)
        if warning is not None:
            await self.publish(warning)

    def _waiting_for(self) -> str:
        """What the trainer waits for, in words (stall warnings and failures)."""
        return self.intake.waiting_for(self.writer.state.ledger, self.need,
                                       self.writer.state.last_step + 1, self.learner.version,
                                       self.watch.rollouters_state())
