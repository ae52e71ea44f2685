"""The trainer's step as a core: what was read goes in, what to write and do comes out.

:class:`StepCore` holds every decision of the trainer's step and no I/O: it never awaits,
never reads a clock (the time comes in with each call) and writes nothing. The shell
(trainer.app) reads, hands the core what it read, and carries out the actions the core
returns, in order, through the trainer's fenced writer (trainer.actions lists them). As
vLLM separates ``EngineCore`` from the process around it, and as the profiler service's
``decide(state)`` returns messages.

One step ``k`` through the core:

1. :meth:`StepCore.start_step`: the profiler's step boundary, ``StepStarted(k)``, and the
   mini-batches already complete (a step begun early by the previous one has them);
2. :meth:`StepCore.take`, once per read, until :attr:`StepCore.gathered`: reports first
   (tickets the rollouters dead-lettered are closed and replaced; answers dead-lettered
   from the trainer's group are answered again), then samples (the intake's verdicts,
   trainer.intake: dead letter, ack, reissue, warning), then, on an idle turn (the samples
   stream had nothing), the run's health (trainer.health: rollouts failing, no rollouter
   alive, the leases of unanswered tickets as :meth:`StepCore.due` asked the shell to look
   them up, a stall); each complete mini-batch is handed to the worker as it comes
   (:class:`~trainer.actions.Train`), and the step's groups so far are judged for failed
   rewards (trainer.rewardfail: above ``reward.max_failure_ratio`` the run stops);
3. the shell waits for the worker to finish the update, then :meth:`StepCore.close_step`:
   the weights version goes up every ``trigger_parameter_sync_step`` steps, a checkpoint
   is due or not, the next step begins early unless this one is profiled or checkpointed;
   after a weights publication :meth:`StepCore.published` asks for their validation when
   due;
4. :meth:`StepCore.finish_step`: ``StepFinished(k)`` with its metrics (the acks of the
   samples it trained go in the same script), the profiler's end of the step, the tickets
   the staleness budget allows for the next steps, and after a checkpoint the trim of the
   streams.

After the last step, :meth:`StepCore.end`: the shell reads (idle turns through
:meth:`StepCore.take`) until :attr:`StepCore.settled`, the answers of the validations still
asked in the log; the run's health is judged on those turns as while a step gathers, so
that wait is said (naming the requests) and fails past ``heartbeat.stall_timeout_s``.

The ledger the core decides on is folded from the events it emits, exactly as the writer
folds them when it writes them (trainer.ledger), so a decision later in one call sees the
tickets an earlier one issued.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Sized

from bus import Delivery, Refusal, RunKeys
from runconfig import Config
from runconfig.stepunit import is_save_update
from runschema.messages import StepFinished, StepStarted, WarningRaised
from tasks import PromptSource
from trainer.actions import (
    Ack,
    Action,
    Closing,
    DeadLetter,
    Due,
    FinishStep,
    Holders,
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
from trainer.budget import max_staleness
from trainer.dispatch import Dispatch, Encode
from trainer.health import Health
from trainer.intake import Complete, Duplicate, Group, Intake, Refuse, Stale
from trainer.ledger import Ledger
from trainer.ledger import apply as ledger_apply
from trainer.metrics import AsyncCounts, StaleWindow, StepShape, step_gauges, verl_step_metrics
from trainer.resumepoints import ResumePoints, sample_bytes
from trainer.rewardfail import RewardGuard, reward_metrics
from trainer.stepwork import may_stream
from trainer.validation import ValidationRequests, last_version

__all__ = ["MAX_READ_SIZE", "READ_SIZE", "StepCore", "next_read_size"]

READ_SIZE = 256
"""Entries the trainer asks of the samples stream in one read, normally."""
MAX_READ_SIZE = 4096
"""The most it asks for while reads come back full and mostly refused (a flood of junk)."""


def next_read_size(size: int, read: int, refused: int) -> int:
    """How many entries the next read asks for, after a read of ``size`` that returned
    ``read`` entries of which ``refused`` were dead-lettered. A full read, at least half
    refused, means junk is queued ahead of the samples: twice as many, up to
    :data:`MAX_READ_SIZE`, so refusing it costs fewer round trips and the real samples
    behind it come sooner. Otherwise (the backlog drained, or samples again) the usual
    :data:`READ_SIZE`."""
    if read >= size and 2 * refused >= read:
        return min(2 * size, MAX_READ_SIZE)
    return READ_SIZE


class StepCore:
    """The decisions of one trainer incarnation's steps, from the ``ledger`` and weights
    ``version`` the log (and a resume) left, at ``now``; ``vocab_size`` and ``max_len``:
    the model's, for checking samples (trainer.validate); ``since_checkpoint``: the steps
    the log finished after the checkpoint the model came from, and ``fell_back``: a resume
    loaded an older one than the newest the log names (corrupt or missing), so a resume
    point is due at once (trainer.resumepoints); ``encode``: a text
    prompt's token ids as the rollouters encode it, for the prompt digest its tickets carry
    (None: only verl data's token ids are digested); ``validated``: the validation requests
    the log answered already (trainer.validation); ``counts``: the run's running counts as
    the log's last StepFinished left them (trainer.metrics.AsyncCounts)."""

    def __init__(self, cfg: Config, prompts: PromptSource, keys: RunKeys, *, ledger: Ledger,
                 version: int, vocab_size: int | None, max_len: int | None,
                 now: float, since_checkpoint: int = 0, fell_back: bool = False,
                 encode: Encode | None = None,
                 validated: Iterable[str] = (), counts: dict[str, float] | None = None
                 ) -> None:
        self.cfg = cfg
        tc, ac = cfg.trainer, cfg.async_training
        self.trigger = ac.trigger_parameter_sync_step
        self.need = ac.require_batches * tc.ppo_mini_batch_size
        """Groups per step."""
        self.ledger = ledger
        self.version = version
        """The weights version the trainer holds (one more after every sync)."""
        self.vocab_size, self.max_len = vocab_size, max_len
        self.intake = Intake(cfg.rollout.max_new_tokens, max_staleness(
            ac.staleness_threshold, self.trigger, ac.require_batches, tc.ppo_mini_batch_size),
            reward_bounds=cfg.reward.bounds)
        self.dispatch = Dispatch(cfg, prompts, keys.dlq, encode=encode)
        self.dispatch.restart_leases(ledger, now)
        self.health = Health(cfg.heartbeat, keys, now)
        self.validations = ValidationRequests(cfg, validated)
        self.window = StaleWindow()
        self.counts = AsyncCounts(counts)
        self.trained_version = version
        """The weights version the closed step trained on (before its sync)."""
        self.rewards = RewardGuard(cfg)
        self.step = 0
        """The step being gathered, or the last one."""
        self.started_at = now
        self.batch: list[Group] | None = None
        """The groups the step being gathered took, in mini-batch order (None: no step
        gathers)."""
        self.closed: list[Group] = []
        """The groups of the step closed and not yet finished."""
        self.early_groups = 0
        """Groups the step being gathered took before it started (trainer/early_groups):
        read while the step before it closed, their mini-batches trained behind its
        weights."""
        self.stale_share = 0.0
        self.trim = False  # the streams are trimmed after the closed step
        self.resume_points = ResumePoints(cfg, since_checkpoint, fell_back=fell_back)
        self.read_size = READ_SIZE
        """How many entries the shell's next read of the samples stream asks for."""
        self.ending = False
        """The last step is finished: only the answers of validations are awaited."""

    # ------------------------------------------------------------------ writes

    def _emit(self, out: list[Action], action: Action) -> None:
        """Append ``action``; fold the ledger events it writes, as the writer will."""
        match action:
            case IssueTickets(event=event):
                self.ledger = ledger_apply(self.ledger, event)
            case Publish(events=events):
                for e in events:
                    self.ledger = ledger_apply(self.ledger, e)
            case FinishStep(finished=finished):
                self.ledger = ledger_apply(self.ledger, finished)
        out.append(action)

    def tickets_written(self, issued: IssueTickets, entry_ids: Sequence[str], now: float
                        ) -> None:
        """The shell wrote these tickets at these prompts entries, at ``now``: their
        leases start."""
        self.dispatch.written(issued.tickets, entry_ids, now)

    def issue(self) -> list[Action]:
        """New tickets, as many as the sync window's staleness budget allows now."""
        out: list[Action] = []
        issued = self.dispatch.issue(self.ledger, self.version)
        if issued is not None:
            self._emit(out, issued)
        return out

    def _reissue(self, out: list[Action], indices: Sequence[int], reason: str) -> None:
        for issued in self.dispatch.reissue(self.ledger, indices, reason, self.version,
                                            self.intake.taken):
            self._emit(out, issued)

    def published(self, step: int) -> list[Action]:
        """Weights :attr:`version` were published after ``step`` updates (a resumed trainer
        publishes the version it holds again, mid-window too): their validation when it is
        due and not answered already (trainer.validation); never waited for here."""
        request = self.validations.due(self.version, self.published_at(step), last_version(
            step, self.trigger, self.cfg.trainer.total_training_steps))
        return [] if request is None else [RequestValidation(request)]

    def published_at(self, step: int) -> int:
        """The update after which weights :attr:`version` were first published, ``step``
        updates done: the last sync (one every ``trigger`` updates), so that a validation
        asked again after a resume mid-window names the step an uninterrupted run names.
        ``step`` itself when the versions do not count syncs of this trigger (a run resumed
        with another one)."""
        return step - step % self.trigger if step // self.trigger == self.version else step

    # ------------------------------------------------------------------ a step

    def start_step(self, step: int, now: float) -> list[Action]:
        """Step ``step`` begins at ``now`` (its duration counts from here)."""
        self.step, self.started_at = step, now
        self.health.progressed(now)
        out: list[Action] = [ProfileStep(step, begin=True),
                             Publish([StepStarted(step=step, param_version=self.version)])]
        if self.batch is None:
            self.batch = []
        self.early_groups = len(self.batch)  # taken while the step before closed
        out.extend(self._feed())
        self._judge_rewards()
        return out

    @property
    def gathered(self) -> bool:
        """The step has all its groups (handed to the worker)."""
        return self.batch is not None and len(self.batch) >= self.need

    def _feed(self) -> list[Train]:
        """The complete mini-batches of the ready groups, up to the step's need; each may
        optimize at once when no stale group can still join the step (may_stream)."""
        mini_batch, batch = self.cfg.trainer.ppo_mini_batch_size, self.batch
        ready = self.intake.ready
        out: list[Train] = []
        while batch is not None and len(batch) < self.need and len(ready) >= mini_batch:
            chunk = ready[:mini_batch]
            del ready[:mini_batch]
            batch.extend(chunk)
            # verl's rejection sampling needs every mini-batch's log-probs on the step's
            # starting weights: no optimizer step before the step's last mini-batch is in.
            optimize = self.cfg.trainer.rollout_rs is None and may_stream(
                ready, self.need - len(batch), self.ledger.open, self.intake.taken,
                self.version)
            out.append(Train([[s for _, s in g.ordered()] for g in chunk], optimize))
        return out

    def take(self, reads: Reads) -> list[Action]:
        """What to write and do after one turn's ``reads`` (see the module docstring)."""
        out: list[Action] = []
        self.health.failed(reads.failures)
        self.health.peers_failed(reads.peer_failed)
        if self.validations.answered(reads.validated):
            self.health.progressed(reads.now)  # the wait at the run's end moved on
        self._take_reports(out, reads)
        if reads.peers is not None:
            self.health.observe(reads.peers, reads.now)
        for claim in reads.claims:  # before the answers they precede in the log
            self.dispatch.claims.claimed(claim)
        refused = reads.refused
        if reads.deliveries:
            self.health.samples_arrived()
            refused += self._take_samples(out, reads.deliveries, reads.now)
        if reads.deliveries or reads.refused or reads.idle:  # a read of the samples stream
            self.read_size = next_read_size(self.read_size,
                                            len(reads.deliveries) + reads.refused, refused)
        if reads.idle:
            self._judge_health(out, reads)
        out.extend(self._feed())
        self._judge_rewards()
        return out

    def _judge_rewards(self) -> None:
        """Raise RewardFailed when the step's groups so far hold more failed rewards than
        ``reward.max_failure_ratio`` allows (trainer.rewardfail). Not while a closed step
        waits for its StepFinished: the next step's groups taken early are judged when it
        starts, so the step before is recorded."""
        if self.batch is not None and not self.closed:
            self.rewards.check(self.step, self.batch, self.need)

    def _take_reports(self, out: list[Action], reads: Reads) -> None:
        """Tickets the rollouters gave up (closed, their slots freed, new tickets issued)
        and answers that went to the dead-letter stream (their tickets reissued)."""
        if reads.dead_tickets:
            closed, events = self.dispatch.close_dead(self.ledger, reads.dead_tickets,
                                                      self.intake.taken)
            for event in events:
                self._emit(out, Publish([event]))
            for index in closed:
                self.intake.drop_partial(index)
            out += self.issue()
        # An answer refused alone (no member of its ticket's group) asks for no new attempt.
        alone = self.intake.alone
        answers = [s for s in reads.lost_samples
                   if (s.sample_id, s.attempt, s.rank) not in alone]
        lost = self.dispatch.lost_answers(self.ledger, answers, self.intake.taken)
        if lost:
            self._reissue(out, lost, "an answer was dead-lettered")

    def _take_samples(self, out: list[Action], deliveries: Sequence[Delivery], now: float
                      ) -> int:
        """The intake's verdicts on one read: its refusals as one dead-letter batch and its
        duplicates as one ack, first (one round trip each, however many: a flood of junk
        must not cost one per entry), then the rest in order. Returns how many it refused."""
        refused: list[Refusal] = []
        duplicates: list[str] = []
        rest: list[Action] = []
        for verdict in self.intake.judge(deliveries, self.ledger, self.version,
                                         self.vocab_size, self.max_len,
                                         claims=self.dispatch.claims,
                                         digest=self.dispatch.digest):
            match verdict:
                case Refuse(delivery, reason, reissue, kind):
                    refused.append(Refusal(delivery, reason, kind))
                    if reissue is not None:
                        self._reissue(rest, [reissue], "an answer was invalid")
                case Duplicate(entry_ids):
                    duplicates += entry_ids
                case Stale(group, message):
                    self.dispatch.answered(group.index, now)
                    rest.append(Ack(group.entry_ids()))
                    rest.append(Warn(WarningRaised(source="trainer",
                                                   code="stale_group_discarded",
                                                   message=message)))
                    self._reissue(rest, [group.index], "answer too stale")
                case Complete(group):
                    self.dispatch.answered(group.index, now)
                    self.health.progressed(now)
        if refused:
            out.append(DeadLetter(refused))
        if duplicates:
            out.append(Ack(duplicates))
        out += rest
        return len(refused)

    # ------------------------------------------------------------------ health

    def due(self, now: float, *, leases: bool = True) -> Due:
        """What the shell reads before an idle turn at ``now``: the peers when a heartbeat
        interval passed (or a lease expired), and with ``leases`` the holders of the open
        tickets not taken whose lease expired."""
        expired = self.dispatch.expired(self.ledger, self.intake.taken, now) if leases else []
        return Due(self.health.peers_due(now) or bool(expired), expired,
                   self.dispatch.entries_of(expired), self.dispatch.owners_to_read())

    def _judge_health(self, out: list[Action], reads: Reads) -> None:
        """An idle turn: rollouts failing, peers gone (raise PeerDead); lost tickets
        reissued; a stall said (or, too long, raised) while a step gathers."""
        self.health.check_failures()
        if reads.peers is not None:
            self.health.check_peers(reads.now)
        if reads.holders is not None:
            self._reissue_lost(out, reads.holders, reads.now)
        if self.batch is not None or not self.settled:
            warning = self.health.check_stall(reads.now, self.waiting_for)
            if warning is not None:
                out.append(Warn(warning, say=True))

    def _reissue_lost(self, out: list[Action], holders: Holders, now: float) -> None:
        """Reissue those of the expired tickets that are lost (trainer.dispatch: gone from
        the stream, held by a dead rollouter or by a live one that makes no progress)."""
        health, dispatch = self.health, self.dispatch
        lost, stuck = dispatch.lost(holders, health.alive(), health.progress, now)
        wedged = {i for tickets in stuck.values() for i in tickets}
        if stuck:
            for warning in dispatch.stuck_warnings(stuck, health.rollouters, health.progress,
                                                   now):
                out.append(Warn(warning))
            self._reissue(out, sorted(wedged), f"held by a rollouter without progress for "
                          f"{dispatch.progress_bound():.0f} s")
        rest = [i for i in lost if i not in wedged]
        if rest:
            self._reissue(out, rest, f"unanswered for {dispatch.lease_s():.0f} s (ticket lease)")

    def waiting_for(self) -> str:
        """What the trainer waits for, in words (stall warnings and failures)."""
        if self.ending:
            return (f"{self.validations.waiting_for()}, after its last step {self.step}; "
                    f"rollouters: {self.health.rollouters_state()}")
        return self.intake.waiting_for(self.ledger, self.need, self.step, self.version,
                                       self.health.rollouters_state())

    def _shape(self, duration: float, measured: Measured, last_prompt: int | None
               ) -> StepShape:
        """What verl's step metrics need beside the samples: ``last_prompt``, the step's
        newest prompt index, gives the data epoch (a source of known size)."""
        prompts = self.dispatch.prompts
        size = len(prompts) if isinstance(prompts, Sized) else 0
        epoch = last_prompt // size if size and last_prompt is not None else 0
        devices = measured.ranks + (len(self.health.rollouters)
                                    * self.cfg.rollout.tensor_model_parallel_size)
        return StepShape(step=self.step, duration_s=duration, update_s=measured.update_s,
                         devices=devices, max_prompt_length=self.cfg.data.max_prompt_length,
                         max_response_length=self.cfg.rollout.max_new_tokens, epoch=epoch)

    # ------------------------------------------------------------------ the run's end

    def end(self) -> None:
        """The last step is finished: what is left is the answers of the validations asked
        (:attr:`settled`)."""
        self.ending = True

    @property
    def settled(self) -> bool:
        """Nothing is awaited at the run's end (before :meth:`end`: True)."""
        return not (self.ending and self.validations.pending)

    # ------------------------------------------------------------------ the step's end

    def close_step(self, profiled: bool) -> Closing:
        """The step's update is done: sync, checkpoint, and whether the next step begins
        now (``profiled``: the profiler brackets each step's work, so it may not)."""
        tc = self.cfg.trainer
        self.closed, self.batch = self.batch or [], None
        self.stale_share = self.window.share(self.closed, self.version)
        self.trained_version = self.version
        save = is_save_update(self.step, tc.save_freq, self.trigger, tc.total_training_steps)
        sync = self.step % self.trigger == 0
        if sync:
            self.version += 1
            self.window.synced()
        trained = sample_bytes(s for g in self.closed for _, s in g.ordered())
        resume_point = self.resume_points.due(saved=save, sync=sync, trained=trained)
        early = None
        if not profiled and not (save or resume_point):
            # Off the critical path: the next step's ready mini-batches train (queued behind
            # the weights' serialisation) while this step's weights, StepFinished and tickets
            # go out. Checkpoint steps keep the boundary serial.
            self.batch = []
            early = self._feed()
        self.trim = (save or resume_point) and self.cfg.run.retention == "checkpoint"
        return Closing(sync, save, early, resume_point)

    def finish_step(self, update: Mapping[str, float], measured: Measured, now: float
                    ) -> list[Action]:
        """The closed step's StepFinished at ``now``, with ``update`` (the worker's metrics)
        and what the shell ``measured``; then the tickets for the steps after it."""
        groups = self.closed
        trained = [pair for g in groups for pair in g.ordered()]
        duration = now - self.started_at
        metrics = dict(update)
        metrics["staleness/window_stale_share"] = self.stale_share
        metrics.update(step_gauges(
            duration, len(trained), measured, ledger=self.ledger,
            capacity=self.dispatch.capacity, reissued=self.dispatch.reissued,
            intake=self.intake, health=self.health))
        metrics["trainer/ranks"] = float(measured.ranks)
        metrics["trainer/early_groups"] = float(self.early_groups)
        metrics.update(measured.laps)  # timing_s/step and its laps (trainer.timing)
        metrics.update(measured.memory)
        metrics.update(verl_step_metrics([s for _, s in trained], self._shape(
            duration, measured, max((g.index for g in groups), default=None))))
        metrics.update(self.counts.step([[s for _, s in g.ordered()] for g in groups],
                                        self.trained_version))
        metrics["fully_async/count/current_param_version"] = float(self.version)
        metrics["fully_async/static/required_samples"] = float(self.need)
        metrics["fully_async/static/staleness_threshold"] = (
            self.cfg.async_training.staleness_threshold)
        metrics.update(reward_metrics(s for _, s in trained))
        out: list[Action] = []
        self._emit(out, FinishStep(StepFinished(
            step=self.step, sample_ids=[s.sample_id for _, s in trained], metrics=metrics,
            duration_s=duration, param_version=self.version,
            entry_ids=[eid for eid, _ in trained])))
        self.intake.trained(groups)
        self.dispatch.trained([g.index for g in groups])
        self.health.progressed(now)
        self.closed = []
        out.append(ProfileStep(self.step, begin=False))
        if self.step < self.cfg.trainer.total_training_steps:
            out += self.issue()
        if self.trim:  # after the step: off its critical path
            out.append(Trim([eid for eid, _ in trained],
                            [hb.rank for hb in self.health.rollouters]))
        return out
