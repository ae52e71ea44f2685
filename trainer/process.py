"""The trainer process on the bus: its parts, its lease, its ranks, and its start from the log.

:class:`TrainerProcess` is the life of one trainer incarnation around its run
(:class:`trainer.app.Trainer`, the shell around the step core): it takes the run's fencing
lease and renews it at every pulse, starts this node's other trainer ranks
(:class:`~trainer.ranks.LocalRanks`) and stops them, and brings the incarnation up to the
log's state before the run begins: the run's files fetched (:class:`~trainer.runfiles.RunFiles`),
the log folded by the :class:`~trainer.writer.Writer` and checked against them, the model and
the profiler agent built, samples pending on earlier incarnations adopted, and, when the run
had started, the model rebuilt (:func:`trainer.resume.rebuild`: the newest checkpoint, then
the steps after it replayed from the samples they recorded).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path

from bus import RUNS_STREAM, Bus, Consumer, Fenced, Lease, entry_key
from policy.text import TextTokenizer, build_tokenizer
from profiling import create_agent, prepare_main_thread
from profiling.driver import StepProfiler
from runconfig import Config, config_to_dict
from runconfig.paths import blob_root, record_dir
from runschema.facts import validation_only_refusal
from runschema.messages import (
    Event,
    Heartbeat,
    RunStarted,
    Sample,
    TrainerResumed,
    WarningRaised,
)
from runtime import Component, Failure
from tasks import build_prompt_source
from trainer.checkpoints import Checkpoints
from trainer.dispatch import ROLLOUTER_GROUP
from trainer.learner import Learner
from trainer.lease import acquire, token
from trainer.ledger import ticket_index
from trainer.metrics import StepMeter
from trainer.rankprofile import RankedAgent
from trainer.ranks import LocalRanks
from trainer.record import Described, Recorder, TextDecoder
from trainer.resume import WeightsMismatch, mismatch_verdict, rebuild, refusal_warnings
from trainer.runfiles import RunFiles
from trainer.stepwork import StepWork
from trainer.validation import Validations
from trainer.watch import Watch
from trainer.weights import Weights, open_broadcaster
from trainer.writer import Writer

__all__ = ["GROUP", "TrainerProcess", "consumer_name"]

GROUP = "trainer"
MAX_LOG_RESTARTS = 5  # starts over from the log after it was found behind (a lost tail)
STOP_RANKS_S = 30.0  # the longest the trainer waits for its other ranks to stop


def consumer_name(epoch: str) -> str:
    """The trainer's member of the samples group: one name per incarnation (its lease
    token's epoch), so what a fenced-out incarnation held is told apart and adopted."""
    return f"trainer-{epoch}"


class TrainerProcess(Component):
    """One trainer incarnation of a run; :meth:`run_loop` is the run itself."""

    role = "trainer"
    max_restarts = MAX_LOG_RESTARTS
    restart_says = "resuming from the log"

    def __init__(self, cfg: Config, bus: Bus) -> None:
        super().__init__(cfg, bus)
        self.files = RunFiles(cfg, self.run_id)
        self.epoch = secrets.token_hex(4)
        self.lease = Lease(bus, self.keys.trainer_lease, token(self.epoch),
                           cfg.heartbeat.timeout_s)
        self.writer = Writer(bus, self.keys, self.lease)
        self.checkpoints = Checkpoints(cfg, bus, self.keys, self.files, self.lease, self.off)
        self.prompts = build_prompt_source(cfg)  # verl data: loaded by the precheck, cached
        self.checkpoints.recorder = self._recorder()
        self.watch = Watch(cfg, bus, self.keys)
        self.local_ranks = LocalRanks(cfg.trainer)  # this process is rank 0 (trainer.ranks)
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
                                 dlq_stream=self.keys.dlq, fence=self.writer,
                                 dlq_max=cfg.redis.dead_letter_max)
        self.tokenizer: TextTokenizer | None = None  # built on the first text prompt
        self.upcoming: StepWork | None = None  # the next step, begun early (StepCore.close_step)
        self.waiting: str | None = None  # what start-up or the run's end waits for (heartbeat)
        self.loaded_checkpoint: int | None = None
        """The step of the checkpoint a resume loaded (older than the newest the log names
        when that one was corrupt or missing); None: not resumed from a checkpoint."""

    async def run_loop(self, resumed: bool) -> int:
        """The run, once the incarnation is up to the log's state; the exit code."""
        raise NotImplementedError

    def _recorder(self) -> Recorder | None:
        """The run's record (``run.record``; trainer.record), None when it is off."""
        mode = self.cfg.run.record
        if mode == "none":
            return None
        data_dir = self.cfg.trainer.rollout_data_dir
        return Recorder(self.bus, self.keys, record_dir(self.cfg, self.run_id),
                        self.files.events_dir, mode=mode, describe=self._describe,
                        decode_text=TextDecoder(self.cfg.model).decode,
                        jsonl_dir=None if data_dir is None else Path(data_dir),
                        push=None if self.files.record_mirror is None
                        else self.files.record_mirror.push)

    def _describe(self, sample: Sample) -> Described:
        """What the data say of a sample's prompt (its ticket's prompt: trainer.dispatch)."""
        index = ticket_index(sample.ticket_id)
        try:
            prompt = self.prompts.get(index) if index is not None else None
        except IndexError:
            prompt = None
        if prompt is None:
            return Described("", "", "")
        return Described(prompt.data_source, prompt.prompt, prompt.answer)

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's token ids as a rollouter encodes it (rollouter.context), for the
        prompt digest its tickets carry; the tokenizer is built once, on first use (verl
        data carry their token ids and never need it)."""
        if self.tokenizer is None:
            self.tokenizer = build_tokenizer(self.cfg.model)
        return self.tokenizer.encode(text, bos=True)

    # ------------------------------------------------------------------ the component

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

    async def serve(self) -> int:
        """The run, with this node's other trainer ranks around it: one that died turns
        whatever failed into a RankFailed naming it."""
        try:
            for line in self.local_ranks.start():
                self.say(line)
            self.waiting = self.local_ranks.joining()
            return await self._serve()
        except Exception as exc:
            failure = await self.local_ranks.failure(exc)
            if failure is not None:
                raise failure from exc
            raise
        finally:
            await self.local_ranks.stop(lambda: self.off(self.learner.stop_ranks), STOP_RANKS_S)

    # ------------------------------------------------------------------ the start

    async def _serve(self) -> int:
        for line in await self.files.fetch():
            self.say(line)
        await self.files.check_covered(
            await self.writer.read_log(self.files.ckpt_dir, self.files.events_dir))
        await self._report_refused()
        self.watch.follow_from(self.writer.position)  # reports: what comes next only
        state, total = self.writer.state, self.cfg.trainer.total_training_steps
        if self.cfg.trainer.val_only and (why := validation_only_refusal(
                self.run_id, state.last_step, state.forked_at)) is not None:
            raise ValidationOnlyRefused(why)
        if state.finished and (state.last_step >= total or self.cfg.trainer.val_only):
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
            # The next checkpoint trims samples below the ones its fallback re-applies after:
            # the checkpoint this incarnation started from, not the log's newest when that
            # could not serve (corrupt, missing): a later start finds it so again and falls
            # back to the same one, which needs every sample trained after it.
            self.checkpoints.fallback = list(
                self.writer.state.entries_of(self.checkpoint_loaded()))
            cfg_tree = config_to_dict(self.cfg)
            await self.publish(RunStarted(run_id=self.run_id, config=cfg_tree, resumed=resumed))
            if not resumed:
                await self.bus.publish(RUNS_STREAM, RunStarted(run_id=self.run_id, config=cfg_tree))
            self.spawn(self.watch.follow(), "watch")
            return await self.run_loop(resumed)
        except Fenced as exc:
            # Any fenced call (a write, the samples group, retention's trim) comes here:
            # a lease that is ours again is a resume from the log, not a second trainer.
            await self.writer.judge_refusal(exc)
            self.say(f"fenced out, another trainer owns run {self.run_id!r}: {exc}", error=True)
            return 1
        finally:
            if self.learner.building is not None:
                with contextlib.suppress(Exception):  # raised where awaited, or moot now
                    await self.learner.building
            if self.upcoming is not None:
                await self.upcoming.settle()
            self.checkpoints.close()

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
        if agent is not None:  # every rank profiles (trainer.rankprofile)
            self.profiler = StepProfiler(
                RankedAgent(agent, self.learner) if self.ranks.active else agent, self.off)

    async def _report_refused(self) -> None:
        """One line per event of the log its fold refused (trainer.state.refusal: facts that
        contradict the log), and its ``fact_refused`` warnings."""
        for r in self.writer.refused:
            self.say(f"refused {r.kind} at {r.entry_id} of {self.keys.events}: {r.reason}",
                     error=True)
        await self.publish(*refusal_warnings(self.writer.refused))
        for why in self.writer.skipped_snapshots:
            await self._warn(WarningRaised(source="trainer", code="checkpoint_corrupt",
                                           message=why))

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

    def checkpoint_loaded(self) -> int:
        """The step of the checkpoint this incarnation started from: the one its resume
        loaded, else the log's newest (0: none)."""
        if self.loaded_checkpoint is not None:
            return self.loaded_checkpoint
        return self.writer.state.checkpoint()[0]

    async def _resume(self) -> None:
        """Rebuild the model the trainer had (checkpoint, then the steps after it)."""
        resumed = await rebuild(self.bus, self.keys, self.writer.state, self.learner, self.off,
                                self.cfg.async_training.trigger_parameter_sync_step,
                                self.writer.entries_read, warn=self._warn,
                                locate=self.files.locate,
                                published_tensors=self.weights.published
                                if self._ranks_changed() is not None else None)
        self.loaded_checkpoint = resumed.checkpoint_step
        await self.publish(resumed)
        if resumed.weights_match is False:
            await self._mismatched(resumed)
        await self.weights.sweep()

    def _ranks_changed(self) -> tuple[int, int] | None:
        """``(before, now)`` when the run's last start trained with another rank count."""
        tc = self.cfg.trainer
        before, now = self.writer.state.ranks, tc.nnodes * tc.n_gpus_per_node
        return (before, now) if before and before != now else None

    async def _mismatched(self, resumed: TrainerResumed) -> None:
        """The rebuilt model does not hash to the weights version it published: stop before
        publishing anything, or say so and go on (trainer.resume.mismatch_verdict)."""
        what = (f"the resumed model (checkpoint of step {resumed.checkpoint_step}, "
                f"{resumed.replayed_steps} steps re-applied) does not hash to weights version "
                f"{self.learner.version} that the trainer published before it stopped")
        fail, code, text = mismatch_verdict(what, self._ranks_changed(), resumed.weights_gap,
                                            self.cfg.trainer.resume_weights_mismatch)
        if fail:
            raise WeightsMismatch(text)
        await self._warn(WarningRaised(source="trainer", code=code, message=text))


class ValidationOnlyRefused(Failure):
    """``trainer.val_only`` on a run that has trained steps of its own
    (runschema.facts.validation_only_refusal): exit 2, nothing written."""

    code = 2
    publish = False
