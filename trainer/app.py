"""The trainer process: a short loop over parts that own their state.

One step ``k`` (1-based), as in docs/architecture.md:

1. apply the profiling commands due at ``k``, publish ``StepStarted(k)``;
2. gather ``require_batches * ppo_mini_batch_size`` complete prompt groups from the samples
   stream, training each mini-batch as soon as it is complete (:mod:`trainer.stepwork`) on
   the worker thread, so the event loop keeps the lease and the liveness key fresh however
   long the update takes;
3. every ``trigger_parameter_sync_step`` steps publish weights, checkpoint when due, then
   ``StepFinished(k, sample_ids, entry_ids, metrics)`` and the acks of those samples in one
   fenced script (an ack never lands without its StepFinished);
4. issue new tickets up to the staleness budget, tagged with the current weights version.

The parts: :class:`~trainer.writer.Writer` (the only one that writes; the state folded from
the log), :class:`~trainer.dispatch.Dispatch` (tickets, leases, budget),
:class:`~trainer.intake.Intake` (verdicts on samples), :class:`~trainer.watch.Watch` (peers,
stalls, reports), :class:`~trainer.learner.Learner` (model, optimizer, version),
:class:`~trainer.weights.Weights` (publication, blob retention),
:class:`~trainer.runfiles.RunFiles` (checkpoints and archive, here and on the storage),
:class:`~trainer.checkpoints.Checkpoints` (written, exported, the log trimmed after one),
:class:`~trainer.collect.Collector` (a step's groups gathered and trained as they come),
:class:`~trainer.ranks.LocalRanks` (this node's other ranks, kept alive and stopped). A
restarted trainer folds the log, loads the latest checkpoint and re-applies the steps after
it (:func:`trainer.resume.rebuild`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time

from bus import Bus, Consumer, Fenced, Lease, entry_key
from bus.keys import RUNS_STREAM
from bus.messages import (
    Event,
    Heartbeat,
    RunFinished,
    RunStarted,
    StepFinished,
    StepStarted,
    WarningRaised,
)
from profiling import create_agent, prepare_main_thread
from profiling.driver import StepProfiler
from runconfig import Config, config_to_dict
from runconfig.paths import blob_root
from runconfig.stepunit import is_save_update
from runtime import Component
from tasks import build_prompt_source
from trainer.budget import max_staleness
from trainer.checkpoints import Checkpoints
from trainer.collect import Collector
from trainer.dispatch import ROLLOUTER_GROUP, Dispatch
from trainer.intake import Intake
from trainer.learner import Learner
from trainer.lease import acquire, token
from trainer.metrics import StepMeter, verl_step_metrics
from trainer.rankprofile import RankedAgent
from trainer.ranks import LocalRanks
from trainer.resume import rebuild, refusal_warnings
from trainer.runfiles import RunFiles
from trainer.stepwork import StepWork
from trainer.validation import Validations, last_version
from trainer.watch import Watch
from trainer.weights import Weights, open_broadcaster
from trainer.writer import Writer

__all__ = ["GROUP", "Trainer", "consumer_name"]

GROUP = "trainer"
MAX_LOG_RESTARTS = 5  # starts over from the log after it was found behind (a lost tail)
STOP_RANKS_S = 30.0  # the longest the trainer waits for its other ranks to stop


def consumer_name(epoch: str) -> str:
    """The trainer's member of the samples group: one name per incarnation (its lease
    token's epoch), so what a fenced-out incarnation held is told apart and adopted."""
    return f"trainer-{epoch}"


class Trainer(Component):
    """The trainer of one run."""

    role = "trainer"
    max_restarts = MAX_LOG_RESTARTS
    restart_says = "resuming from the log"

    def __init__(self, cfg: Config, bus: Bus) -> None:
        super().__init__(cfg, bus)
        tc, ac = cfg.trainer, cfg.async_training
        self.files = RunFiles(cfg, self.run_id)
        self.epoch = secrets.token_hex(4)
        self.lease = Lease(bus, self.keys.trainer_lease, token(self.epoch),
                           cfg.heartbeat.timeout_s)
        self.writer = Writer(bus, self.keys, self.lease)
        self.checkpoints = Checkpoints(cfg, bus, self.keys, self.files, self.lease, self.off)
        # verl data (data.train_files) were loaded and checked by the precheck: cached.
        prompts = build_prompt_source(cfg)
        self.dispatch = Dispatch(cfg, bus, self.keys, self.writer, prompts)
        self.intake = Intake(cfg.rollout.max_new_tokens, max_staleness(
            ac.staleness_threshold, ac.trigger_parameter_sync_step, ac.require_batches,
            tc.ppo_mini_batch_size))
        self.watch = Watch(cfg, bus, self.keys)
        # Trainer ranks (trainer.ranks): this process is rank 0; the others run what its
        # learner tells them.
        self.local_ranks = LocalRanks(tc)
        self.ranks = self.local_ranks.group
        self.learner = Learner(cfg, self.ranks)
        if self.files.mirror is not None:  # dcp shards: every rank writes its own there
            self.learner.remote_checkpoints = self.files.mirror.where()
        self.weights = Weights(bus, self.keys, self.writer, blob_root(cfg, self.run_id),
                               self.epoch, transport=cfg.rollout.weights_transport,
                               broadcaster=open_broadcaster(cfg, bus, self.keys, self.epoch,
                                                            self._warn))
        self.validations = Validations(cfg, bus, self.keys, self.writer)
        # What the trainer writes answers what it read from the other roles' streams: its
        # entries come after those in the merged log, even within one millisecond.
        self.writer.floor = self._read_floor
        self.meter = StepMeter()
        # Fenced by the writer: a zombie of this trainer cannot read, ack or dead-letter a
        # sample once another trainer holds the lease.
        self.consumer = Consumer(bus, self.keys.samples, GROUP, consumer_name(self.epoch),
                                 dlq_stream=self.keys.dlq, fence=self.writer)
        self.collector = Collector(cfg, consumer=self.consumer, writer=self.writer,
                                   intake=self.intake, dispatch=self.dispatch,
                                   watch=self.watch, meter=self.meter, learner=self.learner,
                                   submit=self.submit, publish=self.publish)
        self.upcoming: StepWork | None = None  # the next step, started early (_loop)
        self.waiting: str | None = None  # what start-up waits for, told by the heartbeat

    # ------------------------------------------------------------------ lifecycle

    async def setup(self) -> None:
        """Take the run's fencing lease (TrainerConflict names a live holder)."""
        await acquire(self.lease, self.run_id, self.cfg.heartbeat)

    async def on_pulse(self) -> None:
        await self.writer.renew()
        self.local_ranks.keep_alive(self.submit, self.learner.keepalive,
                                    busy=self.learner.building is not None)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(role="trainer", rank=0, pid=os.getpid(),
                         state=self.waiting or f"step {self.writer.state.last_step}",
                         metrics={"trainer/version": float(self.learner.version)})

    def _read_floor(self) -> str | None:
        """The newest entry the trainer has read from the other roles' streams."""
        read = [i for i in (self.watch.events.newest(), self.validations.events.newest())
                if i is not None]
        return max(read, key=entry_key) if read else None

    async def publish(self, *events: Event) -> None:
        """Every event of the trainer goes through its fenced writer."""
        await self.writer.publish(*events)

    async def teardown(self) -> None:
        with contextlib.suppress(Exception):  # Redis may be what failed: the lease lapses
            await self.lease.release()

    def _build(self) -> None:
        """The ranks joined, the model, and the profiler agent when profiling is on (worker
        thread)."""
        if self.ranks.active:
            self.ranks.open()
            self.ranks.send("config", (config_to_dict(self.cfg), self.writer.state.last_step))
            self.waiting = None
        self.learner.build()
        agent = create_agent(self.cfg, "trainer", 0, str(self.learner.device),
                             after_step=self.writer.state.last_step)
        if agent is not None and self.ranks.active:  # every rank profiles (trainer.rankprofile)
            agent = RankedAgent(agent, self.learner)
        if agent is not None:
            self.profiler = StepProfiler(agent, self.off)

    async def serve(self) -> int:
        """The run, with this node's other trainer ranks around it: one that died turns
        whatever failed into a RankFailed naming it."""
        try:
            for line in self.local_ranks.start():
                self.say(line)
            self.waiting = self.local_ranks.joining()
            return await self._serve()
        except Exception as exc:
            failure = self.local_ranks.failure(exc)
            if failure is not None:
                raise failure from exc
            raise
        finally:
            await self.local_ranks.stop(lambda: self.off(self.learner.stop_ranks), STOP_RANKS_S)

    async def _serve(self) -> int:
        for line in await self.files.fetch():
            self.say(line)
        read = await self.writer.read_log(self.files.ckpt_dir, self.files.events_dir)
        await self.files.check_covered(read)
        await self._report_refused()
        self.watch.follow_from(self.writer.position)  # reports: what comes next only
        state, total = self.writer.state, self.cfg.trainer.total_training_steps
        if state.finished and state.last_step >= total:
            self.say(f"run {self.run_id} already finished at step {state.last_step}")
            return 0
        self.meter.loop_cpu_at = time.thread_time()
        # Kineto on the thread that imported torch, before the worker's agent warms up.
        prepare_main_thread(self.cfg, str(self.learner.device))
        await self.off(self._build)
        self.learner.build_optimizer()  # on a thread of its own; weights v0 serialise meanwhile
        resumed = state.started
        if self.weights.broadcaster is not None:
            self.spawn(self.weights.broadcaster.run(), "weights-broadcast")
        await self.consumer.ensure_group()
        await Consumer(self.bus, self.keys.prompts, ROLLOUTER_GROUP, "trainer",
                       dlq_stream=self.keys.dlq).ensure_group()
        try:
            await self._adopt()
            if resumed:
                await self._resume()
            cfg_tree = config_to_dict(self.cfg)
            await self.publish(RunStarted(run_id=self.run_id, config=cfg_tree, resumed=resumed))
            if not resumed:
                await self.bus.publish(RUNS_STREAM, RunStarted(run_id=self.run_id, config=cfg_tree))
            self.spawn(self.watch.follow(), "watch")
            return await self._loop(resumed)
        except Fenced as exc:
            self.say(f"fenced out, another trainer owns run {self.run_id!r}: {exc}", error=True)
            return 1
        finally:
            if self.learner.building is not None:
                with contextlib.suppress(Exception):  # raised where awaited, or moot now
                    await self.learner.building
            if self.upcoming is not None:
                await self.upcoming.settle()
            self.checkpoints.close()

    async def _report_refused(self) -> None:
        """One line per event of the log its fold refused (trainer.state.refusal: facts that
        contradict the log), and its ``fact_refused`` warnings."""
        for r in self.writer.refused:
            self.say(f"refused {r.kind} at {r.entry_id} of {self.keys.events}: {r.reason}",
                     error=True)
        await self.publish(*refusal_warnings(self.writer.refused))

    async def _warn(self, warning: WarningRaised) -> None:
        self.say(warning.message, error=True)
        await self.publish(warning)

    async def _adopt(self) -> None:
        """Samples pending on earlier incarnations (fenced out, or dead) become ours, read
        first; their members leave the group, so names do not pile up over a run."""
        taken = await self.consumer.adopt()
        if taken:
            self.say(f"adopted {sum(taken.values())} pending samples of {len(taken)} earlier "
                     f"trainer(s) ({', '.join(sorted(taken))})")

    async def _resume(self) -> None:
        """Rebuild the model the trainer had (checkpoint, then the steps after it)."""
        resumed = await rebuild(self.bus, self.keys, self.writer.state, self.learner, self.off,
                                self.cfg.async_training.trigger_parameter_sync_step,
                                self.writer.entries_read, warn=self._warn,
                                locate=self.files.locate)
        await self.publish(resumed)
        if resumed.weights_match is False:
            await self.publish(WarningRaised(
                source="trainer", code="resume_weights_mismatch",
                message=f"the resumed model does not hash to weights version "
                        f"{self.learner.version} that the trainer published before it stopped"))
        await self.weights.sweep()
        self.dispatch.restart_leases()

    # ------------------------------------------------------------------ the run

    async def _loop(self, resumed: bool) -> int:
        self.watch.rollouters_seen_at = time.monotonic()  # rollouters are judged from here on
        if self.profiler is not None and not resumed:
            await self._wait_for_profiler()
        await self.apply_commands()
        first = self.writer.state.last_step + 1
        # Step barrier (docs/profiling.md): close commands for step `first` before weights
        # (version 0) let a rollouter begin it; guarded StartProfiles for it now fail.
        await self.bus.set_barrier(self.keys.barrier, first)
        # Resumed too: rollouters may hold weights the log no longer vouches for (a lost
        # tail); the newest publication in log order is what they load.
        await self.weights.publish(self.learner.version, self.writer.state.last_step,
                                   self.submit(self.learner.snapshot))
        await self.dispatch.issue(self.learner.version)
        await self._validate(first - 1)  # after the first tickets: they are generated first
        await self.learner.optimizer_ready()  # the rollouters generate step `first` meanwhile
        total = self.cfg.trainer.total_training_steps
        for step in range(first, total + 1):
            await self._step(step)
        await self.validations.settle(self.watch.check_peers)  # the last version's figures
        if self.profiler is not None:
            await self.publish(*(await self.profiler.close()))
            self.profiler = None
        if (warning := await self.checkpoints.exported()) is not None:  # before RunFinished
            await self.publish(warning)
        # The steps the log holds (a run resumed with fewer total steps has more).
        await self.publish(RunFinished(run_id=self.run_id, steps=self.writer.state.last_step))
        self.say(f"run {self.run_id} finished ({total} steps)")
        return 0

    async def _step(self, step: int) -> None:
        """Train step ``step``, publish what it made, finish it (see the module docstring)."""
        tc, trigger = self.cfg.trainer, self.cfg.async_training.trigger_parameter_sync_step
        self.writer.check_fenced()
        await self.apply_commands()
        t0 = time.monotonic()  # the step's clock starts where its `step:K` annotation does
        if self.profiler is not None:
            await self.publish(*(await self.profiler.begin(step)))
        await self.publish(StepStarted(step=step, param_version=self.learner.version))
        work, self.upcoming = self.upcoming, None
        groups, metrics = await self.collector.gather(work)
        metrics["staleness/window_stale_share"] = self.meter.window_stale_share(
            groups, self.learner.version)
        # Close step+1 to commands before its weights (or our next control read) exist.
        await self.bus.set_barrier(self.keys.barrier, step + 1)
        save = is_save_update(step, tc.save_freq, trigger, tc.total_training_steps)  # verl's unit
        serialised = None
        if step % trigger == 0:
            self.learner.version += 1
            self.meter.synced()
            serialised = self.submit(self.learner.snapshot)
        if self.profiler is None and not save:
            # Off the critical path: the next step's ready mini-batches train (queued behind
            # the weights' serialisation) while this step's weights, StepFinished and tickets
            # go out. Profiled runs keep the boundary serial (the agent's step_end/step_begin
            # bracket each step's work), and so do checkpoint steps.
            self.upcoming = self.collector.begin()
        if serialised is not None:
            await self.weights.publish(self.learner.version, step, serialised)
            await self._validate(step)
        saved = None
        if save:
            saved, events = await self.checkpoints.save(step, self.learner, self.writer)
            await self.publish(*events)
        await self.watch.fresh_peers()  # for rollouter/idle_ratio: as fresh as their pulses
        trained = [pair for g in groups for pair in g.ordered()]
        duration = time.monotonic() - t0
        metrics.update(self._run_metrics(duration, len(trained)))
        metrics["trainer/ranks"] = float(self.ranks.world)
        metrics.update(verl_step_metrics([s for _, s in trained], self.cfg.rollout.max_new_tokens,
                                         self.collector.update_s))
        entry_ids = [eid for eid, _ in trained]
        await self.writer.finish_step(StepFinished(
            step=step, sample_ids=[s.sample_id for _, s in trained], metrics=metrics,
            duration_s=duration, param_version=self.learner.version, entry_ids=entry_ids),
            GROUP)
        self.consumer.acked(entry_ids)
        self.intake.trained(groups)
        self.dispatch.trained([g.index for g in groups])
        self.watch.progressed()
        if self.profiler is not None:
            await self.publish(*(await self.profiler.end(step)))
        if step < tc.total_training_steps:
            await self.dispatch.issue(self.learner.version)
        if saved is not None and self.cfg.run.retention == "checkpoint":
            await self._trim(entry_ids)  # after the step: off its critical path

    async def _trim(self, trained: list[str]) -> None:
        """Retention after a durable checkpoint (trainer.checkpoints)."""
        warning = await self.checkpoints.trim(
            trained, last_step=self.writer.state.last_step,
            current=self.writer.state.checkpoint()[1],
            rollouter_ranks=[hb.rank for hb in self.watch.rollouters])
        if warning is not None:
            await self.publish(warning)

    async def _validate(self, step: int) -> None:
        """Request the validation of the weights just published after ``step`` updates when
        it is due (trainer.validation); never waited for here."""
        await self.validations.published(self.learner.version, step, last_version(
            step, self.cfg.async_training.trigger_parameter_sync_step,
            self.cfg.trainer.total_training_steps))

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

    def _run_metrics(self, duration: float, n_samples: int) -> dict[str, float]:
        return self.meter.report(duration, n_samples, update_s=self.collector.update_s,
                                 ledger=self.writer.state.ledger, capacity=self.dispatch.capacity,
                                 reissued=self.dispatch.reissued, intake=self.intake,
                                 watch=self.watch)
