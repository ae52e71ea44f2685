"""The rollouter process: claims prompt tickets, generates with the weights it holds, publishes
samples tagged with the weight versions used, then acks the tickets.

Profiling steps are the trainer's update numbers on every role (profiling.steps): rollouter
step ``K`` begins when it reads ``StepFinished(K-1)`` and ends when it reads ``StepFinished(K)``,
whatever weights it holds. Step 1 begins when it reads weights version 0, which the trainer
publishes only after the profiler service said ProfilerReady (or the handshake timed out); the
rollouter reads the control stream right before it begins any step, so the commands for a step
always precede it.

New weights are loaded between batches, or between chunks of tokens when
``async_training.partial_rollout`` is on (then a sample's min and max versions differ). On a
streaming engine (vLLM) there are no batches: :class:`~rollouter.continuous.ContinuousRollout`
feeds each ticket to the running engine as it is claimed.

The parts: :class:`~rollouter.tickets.TicketDesk` (tickets read ahead, retried, answered),
:class:`~rollouter.weights.HeldWeights` (the weights held and staged),
:class:`~rollouter.stepwatch.StepWatch` (profiling steps after the trainer's),
:class:`~rollouter.presence.TrainerPresence` (the trainer's lease), the engine
(:mod:`rollouter.engine`), the reward pool (:mod:`rollouter.scoring`) and the samples a
batch becomes (:mod:`rollouter.answers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from bus import (
    Bus,
    Consumer,
    Entry,
    RunKeys,
)
from bus.facts import run_finished_refusal
from bus.messages import (
    Heartbeat,
    PromptTicket,
    RunFinished,
    RunStarted,
    Sample,
    ValidationFinished,
    ValidationRequested,
    WarningRaised,
    WeightsPublished,
)
from bus.ranks import RankClaim
from bus.weights_collective import STORE as COLLECTIVE
from bus.weights_collective import Member, Receiver
from policy import resolve_device
from policy.text import build_tokenizer
from profiling import create_agent, prepare_main_thread
from profiling.driver import StepProfiler
from rollouter.answers import Seq, to_samples
from rollouter.continuous import ContinuousRollout
from rollouter.engine import Engine, build_engine, streams
from rollouter.presence import TrainerGone, TrainerPresence
from rollouter.scoring import RewardPool, Score, ScoreItem
from rollouter.stepwatch import StepWatch
from rollouter.tickets import GROUP, TicketDesk
from rollouter.validation import Validator, build_validator
from rollouter.weights import HeldWeights, WeightsLost, fetch_published
from runconfig import Config, ConfigError
from runconfig.paths import blob_root
from runtime import Component, Failure, LogFollower, settle_heap
from runtime.ranks import join_rank

__all__ = ["Rollouter", "TrainerGone"]

ENGINE_CLOSE_S = 30.0  # the longest an engine's shutdown may hold the exit


class BadRewardConfig(Failure):
    """The reward settings cannot work (a missing or broken reward file, ...): exit 2."""

    code = 2
    publish = False


class Rollouter(Component):
    """One rollouter replica (``rollout.rank``, claimed at :meth:`join`); :meth:`run` returns
    the exit code."""

    role = "rollouter"

    @classmethod
    async def join(cls, cfg: Config, bus: Bus) -> tuple[Config, RankClaim | None]:
        """Claim ``rollout.rank`` on the bus (unset: the lowest rank no live rollouter
        holds): a replica joins a running run without knowing how many there are, and a
        second process with a rank a live process holds exits 2 naming it and its holder
        (:mod:`runtime.ranks`)."""
        name = f"{cls.role}{'' if cfg.rollout.rank is None else cfg.rollout.rank}"
        claim = await join_rank(cfg, bus, cls.role, cfg.rollout.rank,
                                lambda text: print(f"{name}: {text}", flush=True))
        rollout = msgspec.structs.replace(cfg.rollout, rank=claim.rank)
        return msgspec.structs.replace(cfg, rollout=rollout), claim

    def __init__(self, cfg: Config, bus: Bus) -> None:
        # Built in-process without joining (tests): rank 0 unless the config names one.
        super().__init__(cfg, bus, rank=cfg.rollout.rank or 0)
        self.consumer = Consumer(
            bus, self.keys.prompts, GROUP, RunKeys.rollouter_consumer(self.rank),
            dlq_stream=self.keys.dlq,
        )
        self.tickets = TicketDesk(bus, self.keys, self.consumer, rank=self.rank,
                                  batch=cfg.rollout.prompts_per_batch, poll=self._poll_events,
                                  publish=self.publish, validates=bool(cfg.data.val_files))
        self.device = resolve_device(cfg.rollout.device)
        self.tokenizer = build_tokenizer(cfg.model)
        self.rewards: RewardPool | None = None  # setup(): a bad reward file is exit 2
        self.weights = HeldWeights(
            f"rollouter{self.rank}", fetch=self._fetch,
            load=lambda state, version: self.off(self.engine.load_state, state, version),
            warn=self.publish, reread=self._poll_events, stranded=self._stranded)
        self.receiver: Receiver | None = None  # the trainer's broadcasts (_receiver)
        self.finished = False
        self.engine: Engine | None = None  # _build(), on the worker thread
        self.engine_warnings: list[str] = []
        # One reader of the log (the trainer's facts, and the replicas' validation answers)
        # for the ticket loop and the step watcher alike.
        self.follower = LogFollower(bus, self.keys, ("trainer", "rollouter"), fold=self._fold,
                                    count=1000)
        self.trainer = TrainerPresence(bus, self.keys.trainer_lease, self.run_id,
                                       cfg.heartbeat.timeout_s)
        # The trainer's step boundaries read from the log: this rollouter's profiling steps.
        self.steps = StepWatch(cfg.trainer.total_training_steps, commands=self.apply_commands,
                               publish=self.publish, poll=self._poll_events)
        self.busy_s = 0.0
        self.window_start = time.monotonic()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(cfg.rollout.seed * 1000 + self.rank)
        # Validation (data.val_files): the requests the log has answered (those to serve
        # wait in self.tickets), and the validator, built at the first request.
        self.validated: set[str] = set()
        self.validator: Validator | None = None
        self.validating: str | None = None  # the request being served (heartbeat state)
        self.stream: ContinuousRollout | None = None  # the loop on a streaming engine (vLLM)

    # ------------------------------------------------------------------ set-up

    async def setup(self) -> None:
        try:
            self.rewards = RewardPool(self.cfg)
        except ConfigError as exc:
            raise BadRewardConfig(str(exc)) from None

    async def teardown(self) -> None:
        if self.rewards is not None:
            self.rewards.close()
        if self.engine is not None:
            # Its own thread: the worker may still be inside a generate call, and a vLLM
            # engine with processes of its own (tensor_model_parallel_size > 1) must not
            # outlive this one.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(self.engine.close), ENGINE_CLOSE_S)

    def _build(self) -> None:
        """On the worker thread (generation and every profiler call run there: the loop
        stays free for liveness, and torch.profiler records the thread it was started on)."""
        torch.set_num_threads(self.cfg.rollout.threads)
        self.engine = build_engine(self.cfg, self.device, self.engine_warnings.append)
        # None when profiling is off: then no profiler object exists at all.
        agent = create_agent(self.cfg, "rollouter", self.rank, str(self.device))
        if agent is not None:
            self.profiler = StepProfiler(agent, self.off)

    async def _tell_engine(self) -> None:
        """Say which engine generates, and publish what its build warned about."""
        self.say(f"generating with the {self.engine.name} engine")
        for text in self.engine_warnings:
            self.say(text, error=True)
            await self.publish(WarningRaised(source=self.name, code="engine_fallback",
                                             message=text))
        self.engine_warnings.clear()

    # ------------------------------------------------------------------ the log

    def _fold(self, entries: Sequence[Entry]) -> None:
        """The follower's fold (every events entry once, in log order): weights (the newest
        in log order wins: after a resume from a log that lost its tail, a lower version is
        the current one), the trainer's step boundaries and the run's end."""
        total = self.cfg.trainer.total_training_steps
        for entry_id, msg in entries:
            last_step = self.steps.finished
            self.steps.observe(msg)
            match msg:
                case WeightsPublished():
                    self.weights.saw(msg)
                case RunStarted():
                    self.finished = False
                case ValidationFinished():
                    self.validated.add(msg.request_id)
                case RunFinished():
                    why = run_finished_refusal(msg.steps, last_step)
                    if why is not None:  # not the trainer's: the run goes on
                        self.say(f"ignored {entry_id} of {self.keys.events}: {why}", error=True)
                    # A run extended with more steps than it finished with goes on.
                    elif msg.steps >= total:
                        self.finished = True

    async def _poll_events(self, block_ms: int | None = None) -> bool:
        """Read new run events (a read that starts now: it sees everything written before
        this call). Once it has read the whole log, this rollouter's profiling steps follow
        the trainer's. Returns whether it has read the whole log."""
        await self.follower.poll(block_ms=block_ms)
        caught_up = self.follower.caught_up
        if caught_up:  # this rollouter's profiling steps follow the trainer's
            await self.steps.follow(self.profiler)
        return caught_up

    # ------------------------------------------------------------------ weights

    @property
    def version(self) -> int:
        """The weights version this replica holds (-1: none yet)."""
        return self.weights.version

    @property
    def newest(self) -> WeightsPublished | None:
        return self.weights.newest

    @property
    def staging(self) -> Any:
        return self.weights.staging

    def _stage(self) -> None:
        self.weights.stage()

    async def _fetch(self, msg: WeightsPublished) -> dict[str, torch.Tensor]:
        return await fetch_published(
            msg, bus=self.bus, keys=self.keys, root=blob_root(self.cfg, self.run_id),
            timeout_s=self.cfg.rollout.weights_fetch_timeout_s, source=self.weights.source,
            warn=self.publish, receiver=self._receiver)

    def _stranded(self, msg: WeightsPublished) -> bool:
        """A broadcast publication that this replica's receiver is neither receiving nor
        holding: no round will bring it once a newer one is published."""
        ref = msg.manifest or msg.ref
        return ref.store == COLLECTIVE and (self.receiver is None
                                            or not self.receiver.coming(ref.key))

    def _receiver(self) -> Receiver:
        """This replica's part in the trainer's weight broadcasts, started at the first
        broadcast publication it reads (whatever its own rollout.weights_transport says: the
        trainer's decides); the next pulse tells the trainer."""
        if self.receiver is None:
            self.receiver = Receiver(self.bus, self.keys, Member(self.rank, os.getpid()))
            self.spawn(self.receiver.run(), "weights-receiver")
            self.pulse_now()
        return self.receiver

    async def _swap_weights(self, wait: bool = True) -> None:
        """Load the newest published weights (rollouter.weights.HeldWeights.swap). Profiling
        steps follow the trainer's StepFinished events, not weight versions (rollouter.stepwatch):
        with trigger_parameter_sync_step > 1 a version spans several steps."""
        await self.weights.swap(wait)

    # ------------------------------------------------------------------ liveness

    def kept_position(self) -> str | None:
        """Where this replica is in the events log, stored at every pulse, so that the
        trainer's events trim (retention) never removes what it has yet to read."""
        return self.follower.position

    def progress(self) -> int:
        """What this process has done, as one counter that only grows: engine steps (a
        long generation moves it at every token), reward calls ended and samples published.
        The pulse runs whatever generation does, so the trainer judges a wedged rollouter
        by this counter, not by its liveness key (trainer.dispatch)."""
        scored = self.rewards.scored if self.rewards is not None else 0
        steps = self.engine.steps if self.engine is not None else 0
        return steps + scored + self.tickets.published

    def heartbeat(self) -> Heartbeat:
        """This replica's pulse: its weights, the share of the time since the last pulse
        it did not generate, and its progress counter."""
        now = time.monotonic()
        window = max(1e-6, now - self.window_start)
        idle = max(0.0, 1.0 - self.busy_s / window)
        self.busy_s, self.window_start = 0.0, now
        metrics = {"rollouter/idle_ratio": idle, "rollouter/version": float(self.version)}
        if self.weights.load_s is not None and self.weights.sync_s is not None:
            metrics["rollouter/weights_load_s"] = self.weights.load_s
            metrics["rollouter/weights_sync_s"] = self.weights.sync_s
        if self.rewards is not None:
            metrics["reward/failed_count"] = float(self.rewards.failures)
            metrics["reward/timeout_count"] = float(self.rewards.timeouts)
        state = f"weights v{self.version}"
        if self.stream is not None:
            state += f", {self.stream.describe()}"
        if self.validating:
            state += f", validating ({self.validating})"
        return Heartbeat(
            role="rollouter", rank=self.rank, pid=os.getpid(), state=state,
            metrics=metrics, progress=self.progress(),
            weights_receiver=self.receiver is not None,
        )

    # ------------------------------------------------------------------ generation

    def _generate(self, seqs: list[Seq], max_tokens: int) -> None:
        """Extend every unfinished sequence by up to ``max_tokens`` with the current weights."""
        rc = self.cfg.rollout
        live = [s for s in seqs if not s.finished]
        if not live:
            return
        out = self.engine.generate(
            [s.prompt + s.tokens for s in live], max_new_tokens=max_tokens,
            temperature=rc.temperature, eos_id=self.eos_ids(), generator=self.generator,
            top_p=rc.top_p, top_k=rc.top_k,
        )
        for s, toks, logps, done in zip(live, out.tokens, out.logprobs, out.finished,
                                        strict=True):
            s.tokens.extend(toks)
            s.logprobs.extend(float(x) for x in logps)
            s.finished = done or len(s.tokens) >= rc.max_new_tokens
            # The version the engine says it generated with, not the one asked of it.
            if s.min_version < 0:
                s.min_version = self.engine.version
            s.max_version = self.engine.version

    async def _generate_all(self, seqs: list[Seq]) -> None:
        """Every sequence to its end; with ``partial_rollout``, in chunks between which new
        weights are picked up mid-sequence."""
        rc = self.cfg.rollout
        if not self.cfg.async_training.partial_rollout:
            await self.off(self._generate, seqs, rc.max_new_tokens)
            return
        while any(not s.finished for s in seqs):
            left = rc.max_new_tokens - min(len(s.tokens) for s in seqs if not s.finished)
            await self.off(self._generate, seqs, min(rc.partial_chunk_tokens, left))
            await self._poll_events()
            await self._swap_weights(wait=False)

    def eos_ids(self) -> list[int]:
        """A response ends at the tokenizer's eos or any the model's generation_config lists."""
        return [i for i in (self.tokenizer.eos_id, *self.engine.eos_ids) if i is not None]

    def prompt_ids(self, ticket: PromptTicket) -> list[int]:
        """The ticket's prompt as token ids: verl data carry theirs (chat template applied,
        truncated), used as given; a text prompt is encoded."""
        if ticket.prompt_ids is not None:
            return list(ticket.prompt_ids)
        return self.tokenizer.encode(ticket.prompt, bos=True)

    async def _rollout(
        self, tickets: Sequence[PromptTicket]
    ) -> tuple[dict[str, list[Sample]], dict[str, str]]:
        """Generate every ticket's responses: (samples by ticket id, errors by ticket id)."""
        # A ticket's n responses share its prompt: encoded once.
        prompts = {t.ticket_id: self.prompt_ids(t) for t in tickets}
        seqs = [Seq(t, i, prompts[t.ticket_id], [], []) for t in tickets for i in range(t.n)]
        t0 = time.monotonic()
        await self._generate_all(seqs)
        gen_s = time.monotonic() - t0
        self.busy_s += gen_s
        scores = await self._score(seqs)
        return to_samples(seqs, scores, prompts, gen_s=gen_s, rank=self.rank,
                          eos_id=self.tokenizer.eos_id, fails_ticket=self._fails_ticket)

    async def _score_items(self, items: list[ScoreItem]) -> list[Score]:
        """Score ``items`` in the reward pool; the one warning about failed scoring is
        published when it first happens."""
        if self.rewards is None:  # a rollouter driven without setup() (tests)
            self.rewards = RewardPool(self.cfg)
        scores = await self.rewards.score(items)
        warning = self.rewards.take_warning()
        if warning is not None:
            self.say(warning, error=True)
            await self.publish(WarningRaised(source=self.name, code="reward_failed",
                                             message=warning))
        return scores

    async def _score(self, seqs: list[Seq]) -> list[Score]:
        """Every response's reward from the reward pool (off the loop, a batch at once)."""
        texts = await self.off(lambda: [self.tokenizer.decode(s.tokens) for s in seqs])
        items = [ScoreItem(
            data_source=s.ticket.data_source, solution_str=text,
            ground_truth=s.ticket.answer if s.ticket.ground_truth is None
            else s.ticket.ground_truth,
            extra_info=s.ticket.extra_info, response_len=len(s.tokens),
        ) for s, text in zip(seqs, texts, strict=True)]
        return await self._score_items(items)

    def _fails_ticket(self, ticket: PromptTicket) -> bool:
        return self.rewards is not None and self.rewards.fails_ticket(ticket.data_source)

    # ------------------------------------------------------------------ serving tickets

    async def _weights_for(
        self, deliveries: list[Any], tickets: list[tuple[str, PromptTicket]]
    ) -> list[tuple[str, PromptTicket]]:
        """Wait until this replica holds weights as new as its tickets ask for (on-policy or
        bounded staleness): the newest it knows of first (maybe staging), then what the log
        has since. Returns the tickets it can serve (a ticket asking for weights no
        publication in the log provides is dead-lettered)."""
        while not self.finished and tickets:
            need = max(t.min_version for _, t in tickets)
            if self.version >= need:
                break
            await self._swap_weights()
            if self.version >= need:
                break
            caught_up = await self._poll_events(block_ms=500)
            await self._swap_weights()
            await self.trainer.check()
            newest = self.newest
            if caught_up and newest is not None and need > newest.version:
                # The trainer publishes weights before the tickets that need them, so once
                # we have read the whole log, a ticket asking for more than its newest
                # weights was issued in a stretch of log that Redis lost (or was forged).
                tickets = await self.tickets.drop_unservable(deliveries, tickets, newest.version)
        return tickets

    async def _serve(self, deliveries: list[Any], polled: bool = False) -> None:
        """Generate for ``deliveries``' tickets and publish the answers; ``polled``: the
        events stream was read after these tickets were (rollouter.tickets)."""
        tickets = await self._weights_for(deliveries, await self.tickets.accept(deliveries))
        if not tickets:
            return
        # These tickets were issued after the StepFinished that begins the step they belong
        # to: read it now, so that their generation lands in that step (profiling.steps).
        if not polled:
            await self._poll_events()
        if self.finished:
            return
        await self._swap_weights(wait=False)
        if not self.finished:
            self.tickets.prefetch()
        try:
            samples, failed = await self._rollout([t for _, t in tickets])
        except Failure:
            raise  # the engine is broken (EngineBroken): this rollouter's named end
        except Exception as exc:  # a failed rollout is an event, never "end of data"
            error = f"generation failed: {type(exc).__name__}: {exc}"
            samples, failed = {}, {t.ticket_id: error for _, t in tickets}
        await self.tickets.retry_or_give_up(deliveries, failed)
        await self.tickets.deliver([(i, t) for i, t in tickets if t.ticket_id in samples],
                                   samples)

    # ------------------------------------------------------------------ validation

    async def _serve_validations(self) -> None:
        """Serve the validation requests read with the last batch (rollouter.validation);
        one already answered in the log (a redelivery) is acked without work."""
        while self.tickets.val_requests and not self.finished:
            d = self.tickets.val_requests.pop(0)
            await self._poll_events()
            if d.msg.request_id in self.validated:
                await self.consumer.ack(d)
                continue
            self.validating = d.msg.request_id
            try:
                finished = await self._validate(d.msg)
            finally:
                self.validating = None
            await self.consumer.publish_and_ack(self.keys.log(self.role), [finished], d.id)
            self.validated.add(finished.request_id)
            self.busy_s += finished.duration_s

    async def _validate(self, request: ValidationRequested) -> ValidationFinished:
        """Validate with the newest weights once they are at least ``request.version``."""
        await self._swap_weights()
        while self.version < request.version and not self.finished:
            caught_up = await self._poll_events(block_ms=500)
            await self._swap_weights()
            await self.trainer.check()
            newest = self.newest
            if caught_up and self.version < request.version and (
                    newest is None or newest.version < request.version):
                return self._val_failed(request, f"weights v{request.version} are not in "
                                                 "the log (a stretch of log Redis lost)")
        try:
            if self.validator is None:
                # Scored by this rollouter's reward pool (validation runs between batches).
                self.validator = await asyncio.to_thread(build_validator, self.cfg,
                                                         self.tokenizer, self._score_items)
            return await self.validator.run(request, policy=self.engine, off=self.off,
                                            version=self.version, rank=self.rank)
        except Failure:
            raise
        except Exception as exc:  # a failed validation is an answer, never a dead rollouter
            return self._val_failed(request, f"{type(exc).__name__}: {exc}")

    def _val_failed(self, request: ValidationRequested, error: str) -> ValidationFinished:
        self.say(f"validation {request.request_id} failed: {error}", error=True)
        return ValidationFinished(request_id=request.request_id, version=self.version,
                                  step=request.step, rank=self.rank, metrics={},
                                  error=error)

    # ------------------------------------------------------------------ the run

    async def serve(self) -> int:
        # Alive from the first moment (the runtime's pulse): building a large model must not
        # look like death.
        # Kineto on the thread that imported torch, before the worker's agent warms up.
        prepare_main_thread(self.cfg, str(self.device))
        await self.off(self._build)
        await self._tell_engine()
        settle_heap()
        await self.consumer.ensure_group()
        try:
            # Weights version 0 first: they come after ProfilerReady, so the control stream
            # already holds every command for step 1 when the step watch reads it.
            await self._first_weights()
            if streams(self.engine):  # vLLM: each ticket fed to the engine as it is claimed
                self.stream = ContinuousRollout(self)
                await self.stream.run()
            else:
                await self._serve_until_finished()
            await self.tickets.delivered()
            self.say(f"run {self.run_id} finished")
            return 0
        finally:
            await self._stop_pipeline()

    async def _first_weights(self) -> None:
        """Wait for the trainer's first publication and load it (or the newest loadable
        one); none loadable for ``rollout.weights_fetch_timeout_s`` since the last
        publication read is :class:`WeightsLost` (never a silent wait for the trainer's
        stall timeout)."""
        timeout = self.cfg.rollout.weights_fetch_timeout_s
        lost_since: float | None = None
        seen = self.weights.seen
        while self.version < 0 and not self.finished:
            if self.newest is not None:
                await self._swap_weights()
                if self.version >= 0:
                    return
            if seen != self.weights.seen:  # a new publication: it may load, wait anew
                lost_since, seen = None, self.weights.seen
            if self.weights.bad:
                lost_since = time.monotonic() if lost_since is None else lost_since
                if time.monotonic() - lost_since >= timeout:
                    raise WeightsLost(
                        f"WeightsLost: none of the published weights could be loaded for "
                        f"{timeout:g} s (rollout.weights_fetch_timeout_s): "
                        f"{self.weights.lost()}")
            await self._poll_events(block_ms=500)
            await self.trainer.check()

    async def _serve_until_finished(self) -> None:
        last_reclaim = time.monotonic()
        while not self.finished:
            deliveries, polled = await self.tickets.next()
            if not deliveries:
                # Nothing to do: the run's end, new weights and the trainer's health.
                await self._poll_events()
                await self._swap_weights(wait=False)
                if self.finished:
                    break
                await self.trainer.check()
                if time.monotonic() - last_reclaim > self.cfg.heartbeat.interval_s:
                    last_reclaim = time.monotonic()
                    deliveries = await self.tickets.reclaim_from_dead_replicas()
                    polled = False
                if not deliveries:
                    continue
            await self._serve(deliveries, polled)
            await self._serve_validations()

    async def _stop_pipeline(self) -> None:
        """The read ahead, the publication in flight and the staged weights, then the step
        watcher between two moves (the runtime closes the agent after this)."""
        await self.tickets.stop()
        await self.weights.cancel()
        await self.steps.stop()

