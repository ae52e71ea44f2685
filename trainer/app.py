"""The trainer: the shell around the step core.

A step's decisions are :class:`trainer.core.StepCore`'s (read its docstring first). This
shell reads (samples through the fenced consumer; reports, peers and ticket holders through
:class:`~trainer.watch.Watch`; validation answers), hands the core what it read, and carries
out the actions the core returns (trainer.actions), in order, through the fenced
:class:`~trainer.writer.Writer`: the only way the trainer writes. A step's mini-batches
train on the worker thread as they come (:class:`~trainer.stepwork.StepWork`), so the event
loop keeps the lease and the liveness key fresh however long the update takes; the next
step's ready mini-batches may start while this one's weights and StepFinished go out.

What comes before the run (the lease, the ranks, the log folded, a resume's rebuild) is
:class:`trainer.process.TrainerProcess`'s. See docs/architecture.md, "The trainer".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from runschema.messages import RunFinished, WarningRaised
from runtime.laps import Laps
from trainer.actions import (
    Ack,
    Action,
    DeadLetter,
    FinishStep,
    IssueTickets,
    Measured,
    ProfileStep,
    Publish,
    Reads,
    RequestValidation,
    Train,
    Trim,
    Warn,
)
from trainer.core import StepCore
from trainer.learner import memory_metrics
from trainer.process import GROUP, TrainerProcess
from trainer.stepwork import StepWork
from trainer.timing import step_clock

__all__ = ["Trainer"]


# While a step's update ends, the next step's samples are read this often (Trainer._finish),
# and once more when it ended: each read is a fenced script (a Redis round trip, ~1 ms of
# the event loop's CPU, ~0.5 ms of Redis's). At 10 ms, an update of half a second (gen-heavy
# runs beside two rollouters) cost ~50 reads a step, most of them finding nothing.
_READ_AHEAD_S = 0.05

# The lap an action's time goes to (trainer.timing); the rest (Train: a mini-batch queued
# on the worker) is the core's judging.
_PHASE: dict[type, str] = {
    ProfileStep: "profiler", Trim: "retention", Publish: "write_events", Warn: "write_events",
    IssueTickets: "issue_tickets", DeadLetter: "acknowledge", Ack: "acknowledge",
    RequestValidation: "write_events", FinishStep: "write_step",
}


class Trainer(TrainerProcess):
    """The trainer of one run."""

    core: StepCore
    """The step's decisions, built when the loop starts from what the log and a resume left."""
    laps: Laps
    """The step window's wall time, lap by lap (trainer.timing): StepFinished's timing_s/*."""

    def clock(self) -> float:
        """The core's clock: the loop's, stopped while Redis does not answer (the bus's
        reach clock). A liveness key, a ticket lease or a progress counter that could not
        be refreshed during an outage is not judged by the outage: after a 90 s Redis pause
        the rollouters re-pulse before they could count as gone."""
        return self.bus.reach_clock()

    # ------------------------------------------------------------------ the run

    async def run_loop(self, resumed: bool) -> int:
        state, learner = self.writer.state, self.learner
        self.laps = step_clock()  # step 1's window holds the loop's start
        newest, loaded = state.checkpoint()[0], self.checkpoint_loaded()
        self.core = StepCore(self.cfg, self.prompts, self.keys, ledger=state.ledger,
                             version=learner.version, vocab_size=learner.vocab_size,
                             max_len=learner.max_len, now=self.clock(),
                             since_checkpoint=state.last_step - loaded,
                             fell_back=loaded < newest,
                             encode=self.encode_prompt,
                             validated=await self.validations.start(),
                             counts=state.counts)
        if self.profiler is not None and not resumed:
            await self._wait_for_profiler()
        await self.apply_commands()
        first = state.last_step + 1
        # Step barrier (docs/profiling.md): close commands for step `first` before weights
        # (version 0) let a rollouter begin it; guarded StartProfiles for it now fail.
        await self.bus.set_barrier(self.keys.barrier, first)
        # Resumed too: rollouters may hold weights the log no longer vouches for (a lost
        # tail); the newest publication in log order is what they load.
        await self.weights.publish(learner.version, state.last_step,
                                   self.submit(learner.snapshot))
        # The validation of the weights published now before the tickets: a rollouter reads
        # and serves it first, so the before-training one (verl's val_before_train) is of
        # the initial model on every engine, not of whatever update a replica holds later.
        await self._act(self.core.published(first - 1))
        if self.cfg.trainer.val_only:
            return await self._validate_only()
        await self._act(self.core.issue())
        await learner.optimizer_ready()  # the rollouters generate step `first` meanwhile
        total = self.cfg.trainer.total_training_steps
        for step in range(first, total + 1):
            await self._step(step)
        await self._settle()
        await self._close_profiler()
        self.waiting = "writing the last checkpoint's Hugging Face directory"
        if (warning := await self.checkpoints.exported()) is not None:  # before RunFinished
            await self.publish(warning)
        for warning in (await self.checkpoints.retained(), await self.checkpoints.record_rest()):
            if warning is not None:
                await self.publish(warning)
        self.waiting = None
        # The steps the log holds (a run resumed with fewer total steps has more).
        await self.publish(RunFinished(run_id=self.run_id, steps=self.writer.state.last_step))
        self.say(f"run {self.run_id} finished ({total} steps)")
        return 0

    async def _validate_only(self) -> int:
        """verl's ``trainer.val_only``: the weights just published are validated (their
        request went out with them: trainer.validation), no ticket is issued and nothing
        trains; the run finishes once the answer is in the log."""
        await self._settle()
        await self._close_profiler()
        state = self.writer.state
        await self.publish(RunFinished(run_id=self.run_id, steps=state.last_step,
                                       validation_only=True))
        self.say(f"run {self.run_id} finished: weights v{self.learner.version} (after step "
                 f"{state.last_step}) validated, nothing trained (trainer.val_only)")
        return 0

    async def _close_profiler(self) -> None:
        if self.profiler is not None:
            self.waiting = "closing the profiler (its last traces)"
            await self.publish(*(await self.profiler.close()))
            self.profiler = None

    async def _step(self, step: int) -> None:
        """Train step ``step``, publish what it made, finish it (trainer.core, steps 1-4)."""
        laps = self.laps
        self.writer.check_fenced()
        await self.apply_commands()
        if (warning := self.checkpoints.collect()) is not None:  # a retention that ended
            await self.publish(warning)
        laps.lap("commands")
        work, self.upcoming = self.upcoming or StepWork(self.submit, self.learner.step()), None
        await self._act(self.core.start_step(step, self.clock()), work)
        update = await self._gather(work)
        closing = self.core.close_step(profiled=self.profiler is not None)
        laps.lap("judge")
        # Close step+1 to commands before its weights (or our next control read) exist.
        await self.bus.set_barrier(self.keys.barrier, step + 1)
        laps.lap("commands")
        self.learner.version = self.core.version
        serialised = self.submit(self.learner.snapshot) if closing.sync else None
        if closing.early is not None:  # the next step's work, queued behind the weights
            self.upcoming = StepWork(self.submit, self.learner.step())
            await self._act(closing.early, self.upcoming)
        if serialised is not None:
            await self.weights.publish(self.learner.version, step, serialised)
            laps.lap("update_weights")
            await self._act(self.core.published(step))
        if closing.save or closing.resume_point:
            _, events = await self.checkpoints.save(step, self.learner, self.writer,
                                                    resume_point=closing.resume_point,
                                                    warn=self._warn)
            await self.publish(*events)
            laps.lap("save_checkpoint")
        now = self.clock()
        last = step == self.cfg.trainer.total_training_steps
        # rollouter/idle_ratio and weights sync, as fresh as pulses; the run's last step
        # always reads them (its StepFinished is every dashboard's last point).
        if last or self.core.due(now, leases=False).peers:
            peers = await self.watch.read_peers()
            laps.lap("read_peers")
            await self._act(self.core.take(Reads(now, peers=peers)), self.upcoming)
        measured = Measured(self.meter.wait_s, work.busy_s, self.meter.loop_cpu(),
                            self.ranks.world, laps.close("judge"),
                            memory_metrics(self.learner.device))
        await self._act(self.core.finish_step(update, measured, self.clock()))
        self.progressed = True

    async def _gather(self, work: StepWork) -> dict[str, float]:
        """Read until the core has the step's groups, each mini-batch training on the
        worker as it comes; the update's metrics once the worker is done with it."""
        self.meter.wait_s = 0.0
        try:
            while not self.core.gathered:
                self.writer.check_fenced()
                await self._act(self.core.take(self._reports()), work)
                work.raise_failures()
                await self._read_turn(work, block_ms=500)
            return await self._finish(work)
        finally:
            await work.settle()
            self.laps.lap("wait_update")

    async def _read_turn(self, work: StepWork, block_ms: int | None) -> None:
        """One read of the samples stream (waiting at most ``block_ms``; None: not at all)
        and the core's verdicts on it. With ``block_ms``, a read that found nothing is an
        idle turn (the peers, expired tickets' holders)."""
        laps = self.laps
        t_read = time.monotonic()
        before = self.consumer.stats.dead_lettered
        # The claims stated so far come with any samples delivered, in the same script.
        deliveries, claims_read = await self.consumer.read_then(
            self.watch.claims_then(), count=self.core.read_size, block_ms=block_ms)
        refused = self.consumer.stats.dead_lettered - before  # undecodable entries
        if not work.running:  # nothing to compute: the trainer waits for samples
            self.meter.wait_s += time.monotonic() - t_read
            laps.lap("wait_samples")
        else:
            laps.lap("read_samples")
        if deliveries:  # with the claims stated before them (trainer.claims)
            claims = await self.watch.read_claims(claims_read)
            laps.lap("read_claims")
            reads = Reads(self.clock(), deliveries=deliveries, refused=refused, claims=claims)
        elif block_ms is not None:  # answers that came during a long update are read first
            reads = (await self._idle_reads(self.clock()))._replace(refused=refused)
            laps.lap("read_peers")
        elif refused:
            reads = Reads(self.clock(), refused=refused)
        else:
            return
        await self._act(self.core.take(reads), work)

    async def _finish(self, work: StepWork) -> dict[str, float]:
        """The step's update, once the worker is done with it. Meanwhile the next step's
        samples are read as they come (never blocking: the update's end is not delayed by a
        read), so its mini-batches that are ready when this step closes train behind this
        step's weights (StepCore.close_step's ``early``) instead of the worker idling while
        the weights, StepFinished and tickets go out. What came since the last of those
        reads is read once the update is done, so the step closes knowing all of it."""
        finish = asyncio.ensure_future(work.finish())
        try:
            while True:
                done, _ = await asyncio.wait({finish}, timeout=_READ_AHEAD_S)
                self.laps.lap("wait_update")
                self.writer.check_fenced()
                await self._read_turn(work, block_ms=None)
                if done:
                    return finish.result()
        finally:
            if not finish.done():  # a read failed meanwhile: the update is settled by _gather
                finish.cancel()
            elif not finish.cancelled():
                finish.exception()  # retrieved: a failure of both is raised once, the read's

    def _reports(self) -> Reads:
        """What the followers read since the last turn (trainer.watch, trainer.validation)."""
        watch = self.watch
        return Reads(self.clock(), dead_tickets=watch.take_dead_tickets(),
                     lost_samples=watch.take_lost_samples(), failures=watch.take_failures(),
                     validated=self.validations.take(), peer_failed=watch.take_peer_failed())

    async def _idle_reads(self, now: float, *, leases: bool = True) -> Reads:
        """An idle turn: the peers and the holders of expired tickets, when the core says
        they are due (StepCore.due)."""
        due = self.core.due(now, leases=leases)
        return Reads(now, peers=await self.watch.read_peers() if due.peers else None,
                     holders=await self.watch.holders(due) if due.expired else None, idle=True)

    async def _settle(self) -> None:
        """After the last step, before RunFinished: read until the answers of the validations
        still asked are in (the last version's figures are in the log when the run finishes).
        Each turn is an idle turn of the core: a stall is said, naming the requests, and
        fails the trainer past ``heartbeat.stall_timeout_s``; no rollouter alive fails it
        too (trainer.health)."""
        self.core.end()
        while not self.core.settled:
            self.waiting = self.core.waiting_for()  # the heartbeat's state
            self.writer.check_fenced()
            await self.validations.poll(block_ms=500)
            now = self.clock()
            due = self.core.due(now, leases=False)
            reads = Reads(now, failures=self.watch.take_failures(),
                          peer_failed=self.watch.take_peer_failed(),
                          validated=self.validations.take(),
                          peers=await self.watch.read_peers() if due.peers else None,
                          idle=True)
            await self._act(self.core.take(reads))
        self.waiting = None

    async def _act(self, actions: Sequence[Action], work: StepWork | None = None) -> None:
        """Carry out the core's actions in order (trainer.actions); ``work``: the step the
        mini-batches go to."""
        self.laps.lap("judge")  # the core's decisions that made them
        for action in actions:
            match action:
                case Train():
                    assert work is not None, "mini-batches outside a step"
                    work.add(action)
                case ProfileStep(step, begin) if self.profiler is not None:
                    boundary = self.profiler.begin if begin else self.profiler.end
                    await self.publish(*(await boundary(step)))
                case ProfileStep():
                    pass
                case Trim(entry_ids, ranks):
                    warning = await self.checkpoints.trim_later(
                        entry_ids, last_step=self.writer.state.last_step,
                        current=self.writer.state.checkpoint()[1], rollouter_ranks=ranks)
                    await self.publish(*([] if warning is None else [warning]))
                case _:
                    await self._write(action)
            self.laps.lap(_PHASE.get(type(action), "judge"))

    async def _write(self, action: Action) -> None:
        """One of the core's writes, through the fenced writer (or the samples consumer it
        fences)."""
        match action:
            case Publish(events):
                await self.writer.publish(*events)
            case Warn(warning, say):
                if say:
                    self.say(f"warning: {warning.message}", error=True)
                await self.writer.publish(warning)
            case IssueTickets():
                ids = await self.writer.issue(action)
                self.core.tickets_written(action, ids, self.clock())
            case DeadLetter(refusals):
                await self.consumer.dead_letter_many(refusals)
            case Ack(entry_ids):
                await self.consumer.ack(*entry_ids)
            case RequestValidation(request):
                await self.validations.request(request)
            case FinishStep(finished):
                await self.writer.finish_step(finished, GROUP)
                self.consumer.acked(finished.entry_ids)

    async def _wait_for_profiler(self) -> None:
        timeout = self.cfg.global_profiler.handshake_timeout_s
        self.waiting = "waiting for ProfilerReady"
        self.pulse_now()
        try:
            if await self.watch.wait_for_profiler(timeout, self.writer.check_fenced):
                return
        finally:
            self.waiting = None
        self.say(f"no ProfilerReady from the profiler service within {timeout} s; going on "
                 "without waiting", error=True)
        await self.publish(WarningRaised(
            source="trainer", code="profiler_handshake_timeout",
            message=f"profiler service sent no ProfilerReady within {timeout} s "
                    "(global_profiler.handshake_timeout_s); step-1 commands may be missed"))
