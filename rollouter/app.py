"""The rollouter process: claims prompt tickets, generates with the weights it holds,
publishes samples tagged with the weight versions used, then acks the tickets.

This module is the shell: the component's life (join, setup, the engine built on the worker
thread, the pulse, teardown) around one rollout loop. What the loop works with is the
:class:`~rollouter.context.RolloutContext` (the log, the tickets, the weights, scoring,
validations, the trainer's presence), wired here from the bus. The loop is picked by the
engine: :class:`~rollouter.batch.BatchRollout` (the built-in engine: tickets in batches) or
:class:`~rollouter.continuous.ContinuousRollout` (a streaming engine, vLLM: each ticket fed
to the running engine as it is claimed).

Profiling steps are the trainer's update numbers on every role (profiling.steps): rollouter
step ``K`` begins when it reads ``StepFinished(K-1)`` and ends when it reads ``StepFinished(K)``,
whatever weights it holds. Step 1 begins when it reads weights version 0, which the trainer
publishes only after the profiler service said ProfilerReady (or the handshake timed out); the
rollouter reads the control stream right before it begins any step, so the commands for a step
always precede it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time

import msgspec
import torch

from bus import Bus, Consumer, RankClaim, RunKeys
from policy import resolve_device
from policy.text import build_tokenizer
from profiling import create_agent, prepare_main_thread
from profiling.driver import StepProfiler
from rollouter.batch import BatchRollout
from rollouter.context import RolloutContext, RolloutLoop
from rollouter.continuous import ContinuousRollout
from rollouter.conversations import Conversations
from rollouter.engine import Engine, build_engine, streams
from rollouter.presence import TrainerGone, TrainerPresence
from rollouter.tickets import GROUP, dead_replicas
from rollouter.weights import State, WeightsFetcher
from runconfig import Config, ConfigError
from runconfig.paths import blob_root
from runschema.messages import Heartbeat
from runtime import Component, Failure, LogFollower, settle_heap
from runtime.ranks import join_rank
from weights.collective_round import Member

__all__ = ["Rollouter", "TrainerGone", "rollout_loop"]

ENGINE_CLOSE_S = 30.0  # the longest an engine's shutdown may hold the exit


class BadRewardConfig(Failure):
    """The reward settings cannot work (a missing or broken reward file, ...): exit 2."""

    code = 2
    publish = False


def rollout_loop(ctx: RolloutContext, engine: Engine) -> RolloutLoop:
    """The loop for ``engine``: continuous admission on a streaming engine, else batches."""
    if streams(engine):
        return ContinuousRollout(ctx, engine)
    return BatchRollout(ctx, engine)


class BadToolConfig(Failure):
    """The tools of ``rollout.multi_turn`` cannot load: exit 2."""

    code = 2
    publish = False


class EngineStartTimeout(Failure):
    """The engine did not start within ``rollout.engine_start_timeout_s``."""


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
        rc = cfg.rollout
        self.consumer = Consumer(bus, self.keys.prompts, GROUP,
                                 RunKeys.rollouter_consumer(self.rank), dlq_stream=self.keys.dlq,
                                 dlq_max=cfg.redis.dead_letter_max)
        self.device = resolve_device(rc.device)
        self.tokenizer = build_tokenizer(cfg.model)
        self.engine: Engine | None = None  # _build(), on the worker thread
        self.born = time.monotonic()  # when the engine's start-up began (heartbeat)
        self.abandoned = False  # the engine's start-up ran past its bound, still running
        self.engine_warnings: list[str] = []
        self.fetcher = WeightsFetcher(
            bus, self.keys, Member(self.rank, os.getpid()), root=blob_root(cfg, self.run_id),
            timeout_s=rc.weights_fetch_timeout_s, source=self.name, warn=self.publish,
            spawn=self.spawn, started=self.pulse_now)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(rc.seed * 1000 + self.rank)
        self.context = RolloutContext(
            cfg, rank=self.rank, keys=self.keys, tokenizer=self.tokenizer, generator=generator,
            off=self.off, source=self.consumer,
            # One reader of the log for the rollout loop and the step watcher alike.
            log=LogFollower(bus, self.keys, ("trainer", "rollouter"), count=1000),
            trainer=TrainerPresence(bus, self.keys.trainer_lease, self.run_id,
                                    cfg.heartbeat.timeout_s, self.keys.log("trainer")),
            fetch=self.fetcher.fetch, load=self._load, stranded=self.fetcher.stranded,
            find_dead=lambda: dead_replicas(bus, self.keys, self.consumer.name,
                                            cfg.heartbeat.timeout_s),
            publish=self.publish, complain=lambda text: self.say(text, error=True),
            commands=self.apply_commands, profiler=lambda: self.profiler)
        self.loop: RolloutLoop | None = None  # serve(), once the engine is built

    # ------------------------------------------------------------------ set-up

    async def setup(self) -> None:
        try:
            self.context.scorer.open()
        except ConfigError as exc:
            raise BadRewardConfig(str(exc)) from None
        try:  # loading a tool may import a user's file: off the loop
            talks = await asyncio.to_thread(Conversations.build, self.cfg, self.tokenizer,
                                            off=self.off)
            self.context.conversations = self.context.validations.conversations = talks
        except ValueError as exc:  # ToolConfigError among them
            raise BadToolConfig(f"rollout.multi_turn: {exc}") from None

    async def teardown(self) -> None:
        self.context.scorer.close()
        if self.context.conversations is not None:
            self.context.conversations.close()
        if self.abandoned:
            # The build still runs on the worker thread, which the interpreter's exit would
            # join: the failure is said and published, the process ends here.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EngineStartTimeout.code)
        if self.engine is not None:
            # Its own thread: the worker may still be inside a generate call, and a vLLM
            # engine with processes of its own (tensor_model_parallel_size > 1) must not
            # outlive this one.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(self.engine.close), ENGINE_CLOSE_S)

    def build(self) -> Engine:
        """On the worker thread (generation and every profiler call run there: the loop
        stays free for liveness, and torch.profiler records the thread it was started on):
        the engine, and the profiler agent when profiling is on."""
        torch.set_num_threads(self.cfg.rollout.threads)
        self.engine = build_engine(self.cfg, self.device, self.engine_warnings.append)
        # None when profiling is off: then no profiler object exists at all.
        agent = create_agent(self.cfg, "rollouter", self.rank, str(self.device))
        if agent is not None:
            self.profiler = StepProfiler(agent, self.off)
        return self.engine

    async def _start_engine(self) -> Engine:
        """The engine, built on the worker (:meth:`build`) within
        ``rollout.engine_start_timeout_s``: no ticket is claimed before (the heartbeat says
        the engine is starting, with no progress counter to judge)."""
        bound = self.cfg.rollout.engine_start_timeout_s
        building = asyncio.ensure_future(self.off(self.build))
        try:
            return await asyncio.wait_for(asyncio.shield(building), bound)
        except TimeoutError:
            self.abandoned = True
            raise EngineStartTimeout(
                f"the {self.cfg.rollout.name} engine did not start in {bound:g} s "
                f"(rollout.engine_start_timeout_s): no ticket was claimed") from None

    async def _tell_engine(self, engine: Engine) -> None:
        """Say which engine generates, and publish what its build warned about."""
        self.say(f"generating with the {engine.name} engine")
        for text in self.engine_warnings:
            await self.context.warn("engine_fallback", text)
        self.engine_warnings.clear()

    async def _load(self, state: State, version: int) -> None:
        """Published weights into the engine, on the worker thread."""
        if self.engine is None:
            raise RuntimeError("weights to load before the engine is built")
        await self.off(self.engine.load_state, state, version)
        # A state worth telling now (the heartbeat names the weights and their load and
        # sync times): the pulse runs once this load's figures are set (rollouter.weights
        # sets them before the loop yields), before the samples these weights make go out.
        self.pulse_now()

    # ------------------------------------------------------------------ liveness

    def kept_position(self) -> str | None:
        """Where this replica is in the events log, stored at every pulse, so that the
        trainer's events trim (retention) never removes what it has yet to read."""
        return self.context.events.position

    def progress(self) -> int:
        """What this process has done, as one counter that only grows: engine steps (a
        long generation moves it at every token), reward calls ended, samples published and,
        with conversations, tool calls ended.
        The pulse runs whatever generation does, so the trainer judges a wedged rollouter
        by this counter, not by its liveness key (trainer.dispatch)."""
        steps = self.engine.steps if self.engine is not None else 0
        talks = self.context.conversations
        tools = talks.toolbox.calls if talks is not None else 0  # tool calls ended
        return steps + self.context.scorer.scored + self.context.tickets.published + tools

    def heartbeat(self) -> Heartbeat:
        """This replica's pulse: its weights, the share of the time since the last pulse
        it did not generate, and its progress counter."""
        ctx, held = self.context, self.context.weights.held
        metrics = {"rollouter/idle_ratio": ctx.idle.take(),
                   "rollouter/version": float(held.version)}
        if held.load_s is not None and held.sync_s is not None:
            metrics["rollouter/weights_load_s"] = held.load_s
            metrics["rollouter/weights_sync_s"] = held.sync_s
        metrics.update(ctx.scorer.metrics())
        if ctx.conversations is not None:
            metrics.update(ctx.conversations.metrics())
        metrics.update(ctx.laps.take())  # the loop's laps since the last pulse
        if self.engine is None:  # no progress counter: the trainer judges none (dispatch)
            return Heartbeat(role="rollouter", rank=self.rank, pid=os.getpid(),
                             state=f"engine starting ({time.monotonic() - self.born:.0f} s)",
                             metrics=metrics, progress=None,
                             weights_receiver=self.fetcher.receiver is not None)
        state = f"weights v{held.version}"
        doing = self.loop.describe() if self.loop is not None else None
        if doing:
            state += f", {doing}"
        if ctx.validations.serving:
            state += f", validating ({ctx.validations.serving})"
        return Heartbeat(
            role="rollouter", rank=self.rank, pid=os.getpid(), state=state,
            metrics=metrics, progress=self.progress(),
            weights_receiver=self.fetcher.receiver is not None,
        )

    # ------------------------------------------------------------------ the run

    async def serve(self) -> int:
        # Alive from the first moment (the runtime's pulse): building a large model must not
        # look like death.
        # Kineto on the thread that imported torch, before the worker's agent warms up.
        prepare_main_thread(self.cfg, str(self.device))
        engine = await self._start_engine()
        await self._tell_engine(engine)
        settle_heap()
        await self.consumer.ensure_group()
        try:
            # Weights version 0 first: they come after ProfilerReady, so the control stream
            # already holds every command for step 1 when the step watch reads it.
            await self.context.weights.first()
            self.loop = rollout_loop(self.context, engine)
            await self.loop.run()
            await self.context.tickets.delivered()
            self.say(f"run {self.run_id} finished")
            return 0
        finally:
            # The read ahead, the publication in flight and the staged weights, then the
            # step watcher between two moves (the runtime closes the agent after this).
            await self.context.stop()
