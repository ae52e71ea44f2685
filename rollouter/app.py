"""The rollouter process: claims prompt tickets, generates with the weights it holds, publishes
samples tagged with the weight versions used, then acks the tickets.

Profiling steps are the trainer's update numbers on every role (profiling.steps): rollouter
step ``K`` begins when it reads ``StepFinished(K-1)`` and ends when it reads ``StepFinished(K)``,
whatever weights it holds. Step 1 begins when it reads weights version 0, which the trainer
publishes only after the profiler service said ProfilerReady (or the handshake timed out); the
rollouter reads the control stream right before it begins any step, so the commands for a step
always precede it.

New weights are loaded between batches, or between chunks of tokens when
``async_training.partial_rollout`` is on (then a sample's min and max versions differ).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from bus import (
    BlobError,
    BlobNotFound,
    Bus,
    Consumer,
    RunKeys,
    read_commands,
    run_with_bus,
    settle_heap,
)
from bus.blobs import open_store
from bus.liveness import peers, pulse_forever
from bus.messages import (
    Array,
    ComponentFailed,
    Event,
    Heartbeat,
    PromptTicket,
    RolloutFailed,
    RunFinished,
    RunStarted,
    Sample,
    WarningRaised,
    WeightsPublished,
)
from policy import build_policy, resolve_device
from policy.text import build_tokenizer
from policy.weights import from_bytes
from profiling import create_agent
from profiling.steps import StepClock, follow, observe
from runconfig import Config, load_or_exit
from tasks.reward import load_reward_fn

__all__ = ["Rollouter", "TrainerGone", "main"]

GROUP = "rollouter"
MAX_ATTEMPTS = 3  # tries of one ticket before it goes to the dead-letter stream
MAX_N = 4096  # responses one ticket may ask for; more is not a ticket we wrote


class TrainerGone(RuntimeError):
    """The trainer never appeared or went silent; the message says which and for how long."""


class _Seq(msgspec.Struct):
    """One response being generated (possibly across weight versions)."""

    ticket: PromptTicket
    index: int
    prompt: list[int]
    tokens: list[int] = []
    logprobs: list[float] = []
    finished: bool = False
    min_version: int = -1
    max_version: int = -1


class Rollouter:
    """One rollouter replica (``rollout.rank``); :meth:`run` returns the exit code."""

    def __init__(self, cfg: Config, bus: Bus) -> None:
        self.cfg = cfg
        self.bus = bus
        self.rank = cfg.rollout.rank
        self.run_id = cfg.run.id or ""
        self.keys = RunKeys(self.run_id)
        self.consumer = Consumer(
            bus, self.keys.prompts, GROUP, RunKeys.rollouter_consumer(self.rank),
            dlq_stream=self.keys.dlq,
        )
        self.device = resolve_device(cfg.rollout.device)
        self.tokenizer = build_tokenizer(cfg.model)
        self.reward_fn = load_reward_fn(cfg.task.reward_fn)
        self.version = -1
        self.loaded: WeightsPublished | None = None
        # Recent publications in log order; the newest loadable one is current.
        self.published: deque[WeightsPublished] = deque(maxlen=8)
        self.bad_weights: set[str] = set()  # blob keys that failed to load
        # The newest publication being fetched and decoded (double buffer), if any.
        self.staging: tuple[WeightsPublished, asyncio.Task[dict[str, torch.Tensor]]] | None = None
        self.finished = False
        self.events_last = "0"
        self.control_last = "0"
        self.trainer_absent_since: float | None = time.monotonic()
        self.trainer_seen = False
        # Generation and every profiler call run on this one thread: the loop stays free
        # for liveness, and torch.profiler records the thread it was started on.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouter-gen")
        self.agent: Any = None
        # The trainer's step boundaries read from the log: this rollouter's profiling steps.
        self.clock = StepClock()
        self.steps_lock = asyncio.Lock()  # one move of the agent's steps at a time, in order
        self.steps_task: asyncio.Task[None] | None = None  # _watch_steps, with an agent only
        self.attempts: dict[str, int] = {}
        self.retry: list[Any] = []
        # A pipeline around the worker: the next tickets are read, and the last batch's
        # samples published (and its tickets acked), while a batch generates; at most one
        # of each in flight.
        self.prefetch: asyncio.Task[list[Any]] | None = None
        self.events_lock = asyncio.Lock()  # one reader of the events stream at a time
        self.delivering: asyncio.Future[list[str]] | None = None
        self.busy_s = 0.0
        self.window_start = time.monotonic()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(cfg.rollout.seed * 1000 + self.rank)

    # ------------------------------------------------------------------ set-up

    def _build(self) -> None:
        torch.set_num_threads(self.cfg.rollout.threads)
        self.policy = build_policy(msgspec.to_builtins(self.cfg.model), self.device)
        self.policy.eval()
        # None when profiling is off: then no profiler object exists at all.
        self.agent = create_agent(self.cfg, "rollouter", self.rank, str(self.device))

    async def _off(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking torch work (generation, weight loading, profiler calls) on the
        worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.worker, functools.partial(fn, *args))

    async def _publish(self, *events: Event) -> None:
        if events:
            await self.bus.publish_many(self.keys.events, list(events))

    async def _poll_events(self, block_ms: int | None = None) -> bool:
        """Read new run events: weights (the newest in log order wins: after a resume from a
        log that lost its tail, a lower version is the current one), the trainer's step
        boundaries (this rollouter's profiling steps follow them once it has read the whole
        log) and the run's end. Returns whether it has read the whole log."""
        async with self.events_lock:  # a read ahead (_read_ahead) may be reading too
            entries, self.events_last = await self.bus.read_after(
                self.keys.events, self.events_last, count=1000, block_ms=block_ms
            )
        total = self.cfg.trainer.total_training_steps
        for _, msg in entries:
            self.clock = observe(self.clock, msg)
            match msg:
                case WeightsPublished() if msg.ref.key not in self.bad_weights:
                    self.published.append(msg)
                case RunStarted():
                    self.finished = False
                # A run extended with more steps than it finished with goes on.
                case RunFinished() if msg.steps >= total:
                    self.finished = True
        caught_up = len(entries) < 1000
        if caught_up:
            await self._follow_steps()
        return caught_up

    async def _follow_steps(self) -> None:
        """Bring the profiler agent to the trainer's current step (profiling.steps): end the
        step it was in, begin each step since, in order. Commands are read first, so a step
        never begins before the commands for it; the agent's calls run on the worker thread,
        between generation batches (or partial-rollout chunks), in one hop."""
        if self.agent is None:
            self.clock, _ = follow(self.clock, self.cfg.trainer.total_training_steps)
            return
        if self.steps_task is None:
            # From where this read ended: the clock holds everything before it.
            self.steps_task = asyncio.create_task(self._watch_steps(self.events_last))
        agent = self.agent
        async with self.steps_lock:
            self.clock, moves = follow(self.clock, self.cfg.trainer.total_training_steps)
            if not moves:
                return
            if any(kind == "begin" for kind, _ in moves):
                await self._apply_commands()

            def run_moves() -> list[Event]:
                events: list[Event] = []
                for kind, step in moves:
                    events += agent.step_begin(step) if kind == "begin" else agent.step_end(step)
                return events

            await self._publish(*(await self._off(run_moves)))

    async def _watch_steps(self, cursor: str) -> None:
        """Background, with a profiler agent: follow the trainer's step boundaries as they
        are written (a blocking read of the events stream, its own cursor), so that the steps
        of a rollouter that waits for tickets move at once, not after its ticket read; those
        of a busy one move as soon as its current generation batch ends (the moves queue on
        the worker thread behind it)."""
        while True:
            entries, cursor = await self.bus.read_after(
                self.keys.events, cursor, count=1000, block_ms=1000
            )
            for _, msg in entries:
                self.clock = observe(self.clock, msg)
            if len(entries) < 1000:
                await self._follow_steps()

    async def _stop_watching_steps(self) -> None:
        """End _watch_steps between two moves (a move cut short would lose its events)."""
        task, self.steps_task = self.steps_task, None
        if task is None:
            return
        async with self.steps_lock:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    async def _apply_commands(self) -> None:
        if self.agent is None:
            return
        commands, self.control_last = await read_commands(
            self.bus, self.keys.control, self.control_last
        )
        for cmd in commands:
            await self._publish(*self.agent.on_command(cmd))

    async def _check_trainer(self) -> None:
        """Raise TrainerGone when the trainer's lease key has been absent for the heartbeat
        timeout: the key's TTL is judged by Redis's clock, and the trainer renews it from a
        loop that its updates never block, so a long step is not silence."""
        timeout = self.cfg.heartbeat.timeout_s
        now = time.monotonic()
        if await self.bus.exists(self.keys.trainer_lease):
            self.trainer_absent_since = None
            self.trainer_seen = True
            return
        if self.trainer_absent_since is None:
            self.trainer_absent_since = now
        waited = now - self.trainer_absent_since
        if waited <= timeout:
            return
        if not self.trainer_seen:
            raise TrainerGone(
                f"no trainer: no trainer lease ({self.keys.trainer_lease}) for run "
                f"{self.run_id!r} in {waited:.0f} s (heartbeat.timeout_s={timeout}); is the "
                "trainer running?"
            )
        raise TrainerGone(
            f"trainer is gone: its lease {self.keys.trainer_lease} lapsed and stayed absent "
            f"for {waited:.0f} s (heartbeat.timeout_s={timeout})"
        )

    @property
    def newest(self) -> WeightsPublished | None:
        """The newest publication (in log order) not known to be unloadable."""
        for msg in reversed(self.published):
            if msg.ref.key not in self.bad_weights:
                return msg
        return None

    def _stage(self) -> None:
        """Start fetching and decoding the newest publication in the background (a double
        buffer): generation with the loaded weights goes on meanwhile, and the swap only
        copies the decoded tensors in (_swap_weights)."""
        newest = self.newest
        if newest is None or newest is self.loaded:
            return
        if self.staging is not None and self.staging[0] is newest:
            return
        self.staging = (newest, asyncio.create_task(self._fetch(newest)))

    async def _fetch(self, msg: WeightsPublished) -> dict[str, torch.Tensor]:
        store = open_store(msg.ref.store, bus=self.bus, run_keys=self.keys,
                           root=Path(self.cfg.run.output_dir) / self.run_id / "blobs")
        blob = await store.get(msg.ref)
        # Decoded on a thread of its own: the generation worker is busy meanwhile.
        return await asyncio.to_thread(from_bytes, blob)

    async def _swap_weights(self, wait: bool = True) -> None:
        """Load the newest published weights if they are not ours; ``wait=False``: only if
        they are already fetched and decoded (else they keep staging, and the caller goes on
        with the weights it has, which its tickets allow)."""
        self._stage()
        if self.staging is None:
            return
        newest, task = self.staging
        if not wait and not task.done():
            return
        self.staging = None
        try:
            state = await task
        except BlobNotFound:
            # Superseded and deleted while we were busy: a newer version is already published.
            self.bad_weights.add(newest.ref.key)
            await self._poll_events()
            return
        except Exception as exc:
            # Corrupt, a WeightsPublished that no trainer wrote, or not a state dict: fall
            # back to the newest loadable publication before it.
            await self._unloadable(newest, exc)
            await self._swap_weights(wait)
            return
        try:
            await self._off(self.policy.load_state, state)
        except Exception as exc:  # a state dict of some other model
            await self._unloadable(newest, exc)
            await self._swap_weights(wait)
            return
        # Profiling steps follow the trainer's StepFinished events, not weight versions
        # (_follow_steps): with trigger_parameter_sync_step > 1 a version spans several steps.
        self.loaded = newest
        self.version = newest.version

    async def _unloadable(self, msg: WeightsPublished, exc: Exception) -> None:
        self.bad_weights.add(msg.ref.key)
        why = str(exc) if isinstance(exc, BlobError) else f"{type(exc).__name__}: {exc}"
        await self._publish(WarningRaised(
            source=f"rollouter{self.rank}", code="weights_unloadable",
            message=f"weights v{msg.version} ({msg.ref.key}) ignored: {why}",
        ))

    async def _store_position(self) -> None:
        """At every pulse: where this replica is in the events log, so that the trainer's
        events trim (retention) never removes what it has yet to read while it is alive."""
        if self.events_last != "0":
            await self.bus.set_position(self.keys.rollouter_position(self.rank), self.events_last)

    def _heartbeat(self) -> Heartbeat:
        """This replica's pulse (bus.liveness.pulse_forever): its weights and the share of
        the time since the last pulse it did not generate."""
        now = time.monotonic()
        window = max(1e-6, now - self.window_start)
        idle = max(0.0, 1.0 - self.busy_s / window)
        self.busy_s, self.window_start = 0.0, now
        return Heartbeat(
            role="rollouter", rank=self.rank, pid=os.getpid(), state=f"weights v{self.version}",
            metrics={"rollouter/idle_ratio": idle, "rollouter/version": float(self.version)},
        )

    # ------------------------------------------------------------------ generation

    def _generate(self, seqs: list[_Seq], max_tokens: int) -> None:
        """Extend every unfinished sequence by up to ``max_tokens`` with the current weights."""
        rc = self.cfg.rollout
        live = [s for s in seqs if not s.finished]
        if not live:
            return
        out = self.policy.generate(
            [s.prompt + s.tokens for s in live], max_new_tokens=max_tokens,
            temperature=rc.temperature, eos_id=self.tokenizer.eos_id, generator=self.generator,
        )
        for s, toks, logps, done in zip(live, out.tokens, out.logprobs, out.finished,
                                        strict=True):
            s.tokens.extend(toks)
            s.logprobs.extend(float(x) for x in logps)
            s.finished = done or len(s.tokens) >= rc.max_new_tokens
            if s.min_version < 0:
                s.min_version = self.version
            s.max_version = self.version

    async def _rollout(
        self, tickets: Sequence[PromptTicket]
    ) -> tuple[dict[str, list[Sample]], dict[str, str]]:
        """Generate every ticket's responses: (samples by ticket id, errors by ticket id)."""
        rc, ac = self.cfg.rollout, self.cfg.async_training
        # A ticket's n responses share its prompt: encoded (and packed, below) once.
        prompts = {t.ticket_id: self.tokenizer.encode(t.prompt, bos=True) for t in tickets}
        seqs = [_Seq(t, i, prompts[t.ticket_id], [], []) for t in tickets for i in range(t.n)]
        t0 = time.monotonic()
        if ac.partial_rollout:
            # Generate in chunks; between chunks, pick up new weights mid-sequence.
            while any(not s.finished for s in seqs):
                left = rc.max_new_tokens - min(len(s.tokens) for s in seqs if not s.finished)
                await self._off(self._generate, seqs, min(rc.partial_chunk_tokens, left))
                await self._poll_events()
                await self._swap_weights(wait=False)
        else:
            await self._off(self._generate, seqs, rc.max_new_tokens)
        gen_s = time.monotonic() - t0
        self.busy_s += gen_s
        samples: dict[str, list[Sample]] = {}
        failed: dict[str, str] = {}
        packed = {tid: Array.of(np.asarray(p, dtype=np.int32)) for tid, p in prompts.items()}
        for s in seqs:
            tid = s.ticket.ticket_id
            if tid in failed:
                continue
            try:
                reward = float(self.reward_fn(self.tokenizer.decode(s.tokens), s.ticket.answer))
            except Exception as exc:  # one prompt's bad reward must not sink its batch-mates
                failed[tid] = f"reward function failed: {type(exc).__name__}: {exc}"
                samples.pop(tid, None)
                continue
            samples.setdefault(tid, []).append(Sample(
                sample_id=f"{tid}/{s.index}", ticket_id=tid,
                prompt_id=s.ticket.prompt_id, index=s.index, n=s.ticket.n,
                prompt_tokens=packed[tid],
                response_tokens=Array.of(np.asarray(s.tokens, dtype=np.int32)),
                logprobs=Array.of(np.asarray(s.logprobs, dtype=np.float32)),
                reward=reward,
                min_version=s.min_version, max_version=s.max_version, rank=self.rank,
                gen_time_s=gen_s, attempt=s.ticket.attempt,
                finish_reason="eos" if s.tokens and s.tokens[-1] == self.tokenizer.eos_id
                else "length",
            ))
        return samples, failed

    async def _serve(self, deliveries: list[Any], polled: bool = False) -> None:
        """Generate for ``deliveries``' tickets and publish the answers; ``polled``: the
        events stream was read after these tickets were (by :meth:`_read_ahead`)."""
        tickets = []
        for d in deliveries:
            if isinstance(d.msg, PromptTicket) and 1 <= d.msg.n <= MAX_N:
                tickets.append((d.id, d.msg))
            elif isinstance(d.msg, PromptTicket):
                await self.consumer.dead_letter(d, f"ticket asks for n={d.msg.n} responses "
                                                   f"(1..{MAX_N})")
            else:
                await self.consumer.dead_letter(d, f"expected a PromptTicket, got "
                                                   f"{type(d.msg).__name__}")
        if not tickets:
            return
        while not self.finished:
            need = max(t.min_version for _, t in tickets)
            if self.version >= need:
                break
            # The ticket demands newer weights than ours (on-policy or bounded staleness):
            # the newest we know of first (maybe staging), then what the log has since.
            await self._swap_weights()
            if self.version >= need:
                break
            caught_up = await self._poll_events(block_ms=500)
            await self._swap_weights()
            await self._check_trainer()
            newest = self.newest
            if caught_up and newest is not None and need > newest.version:
                # The trainer publishes weights before the tickets that need them, so once
                # we have read the whole log, a ticket asking for more than its newest
                # weights was issued in a stretch of log that Redis lost (or was forged).
                await self._drop_unservable(deliveries, tickets, newest.version)
                tickets = [(i, t) for i, t in tickets if t.min_version <= newest.version]
                if not tickets:
                    return
        # These tickets were issued after the StepFinished that begins the step they belong
        # to: read it now, so that their generation lands in that step (profiling.steps).
        if not polled:
            await self._poll_events()
        if self.finished:
            return
        await self._swap_weights(wait=False)
        self._prefetch()
        try:
            samples, failed = await self._rollout([t for _, t in tickets])
        except Exception as exc:  # a failed rollout is an event, never "end of data"
            error = f"generation failed: {type(exc).__name__}: {exc}"
            samples, failed = {}, {t.ticket_id: error for _, t in tickets}
        # A failed ticket is retried here, then dead-lettered after MAX_ATTEMPTS (counting the
        # deliveries before ours); the trainer then frees its budget slot.
        for ticket_id, error in failed.items():
            await self._publish(RolloutFailed(ticket_id=ticket_id, rank=self.rank, error=error))
        for d in deliveries:
            tid = getattr(d.msg, "ticket_id", None)
            if tid not in failed:
                continue
            self.attempts[tid] = self.attempts.get(tid, d.deliveries - 1) + 1
            if self.attempts[tid] >= MAX_ATTEMPTS:
                del self.attempts[tid]
                await self.consumer.dead_letter(
                    d, f"rollout failed {MAX_ATTEMPTS} times; last: {failed[tid]}"
                )
            else:
                self.retry.append(d)
        done = [(entry_id, t) for entry_id, t in tickets if t.ticket_id in samples]
        if not done:
            return
        # All responses of these tickets land together with the acks of their tickets, in
        # the background: the next batch generates meanwhile.
        batch = [sample for _, t in done for sample in samples[t.ticket_id]]
        await self._delivered()
        publish = self.consumer.publish_and_ack(self.keys.samples, batch,
                                                *(entry_id for entry_id, _ in done))
        self.delivering = asyncio.ensure_future(publish)

    async def _delivered(self) -> None:
        """Wait for the batch being published (if any); its failure is raised here."""
        task, self.delivering = self.delivering, None
        if task is not None:
            await task

    def _prefetch(self) -> None:
        """Start reading the next tickets while this batch generates (:meth:`_read_ahead`)."""
        if self.prefetch is None and not self.retry and not self.finished:
            self.prefetch = asyncio.create_task(self._read_ahead())

    async def _read_ahead(self) -> list[Any]:
        """The next tickets (a blocking XREADGROUP, at most 200 ms), then the events after
        them: the StepFinished that begins their step precedes them in the log."""
        deliveries = await self.consumer.read(count=self.cfg.rollout.prompts_per_batch,
                                              block_ms=200)
        if deliveries:
            await self._poll_events()
        return deliveries

    async def _next_deliveries(self) -> tuple[list[Any], bool]:
        """Tickets to serve next (retries first, then the read ahead, else a read now, each
        followed by the events after it) and whether the events were read after them."""
        if self.retry:
            deliveries, self.retry = self.retry, []
            return deliveries, False
        task, self.prefetch = self.prefetch, None
        return await (task if task is not None else self._read_ahead()), True

    async def _reclaim_from_dead_replicas(self) -> list[Any]:
        """Tickets pending on replicas whose liveness key has lapsed (by Redis's clock): a
        slow replica generating for minutes keeps its tickets; a dead one's come back."""
        members = await self.bus.consumers(self.keys.prompts, GROUP)
        if not members:
            return []
        alive = {RunKeys.rollouter_consumer(hb.rank)
                 for hb in await peers(self.bus, self.keys.alive_pattern("rollouter"))}
        dead = [m for m in members if m not in alive and m != self.consumer.name]
        return await self.consumer.reclaim_from(dead) if dead else []

    async def _drop_unservable(
        self, deliveries: list[Any], tickets: list[tuple[str, PromptTicket]], newest: int
    ) -> None:
        ids = {i for i, t in tickets if t.min_version > newest}
        for d in deliveries:
            if d.id in ids:
                await self.consumer.dead_letter(
                    d, f"ticket asks for weights v{d.msg.min_version} but the newest in the "
                       f"log is v{newest}: issued in a stretch of log Redis lost")

    async def run(self) -> int:
        # Alive from the first moment: building a large model must not look like death.
        beat = self.cfg.heartbeat
        hb = asyncio.create_task(pulse_forever(
            self.bus, self.keys.alive("rollouter", self.rank), self._heartbeat,
            beat.interval_s, beat.timeout_s, before=self._store_position))
        await self._off(self._build)
        settle_heap()
        await self.consumer.ensure_group()
        try:
            # Weights version 0 first: they come after ProfilerReady, so the control stream
            # already holds every command for step 1 when _follow_steps reads it.
            while self.newest is None and not self.finished:
                await self._poll_events(block_ms=500)
                await self._check_trainer()
            await self._swap_weights()
            last_reclaim = time.monotonic()
            while not self.finished:
                deliveries, polled = await self._next_deliveries()
                if not deliveries:
                    # Nothing to do: the run's end, new weights and the trainer's health.
                    await self._poll_events()
                    await self._swap_weights(wait=False)
                    if self.finished:
                        break
                    await self._check_trainer()
                    if time.monotonic() - last_reclaim > self.cfg.heartbeat.interval_s:
                        last_reclaim = time.monotonic()
                        deliveries, polled = await self._reclaim_from_dead_replicas(), False
                    if not deliveries:
                        continue
                await self._serve(deliveries, polled)
            await self._delivered()
            print(f"rollouter{self.rank}: run {self.run_id} finished", flush=True)
            return 0
        except TrainerGone as exc:
            print(f"rollouter{self.rank}: {exc}", file=sys.stderr, flush=True)
            await self._publish(ComponentFailed(role="rollouter", rank=self.rank, error=str(exc)))
            return 1
        finally:
            pipeline = (self.prefetch, self.delivering)
            self.prefetch = self.delivering = None
            for task in (hb, *((self.staging[1],) if self.staging else ()),
                         *(t for t in pipeline if t is not None)):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if self.agent is not None:
                await self._stop_watching_steps()
                with contextlib.suppress(Exception):
                    await self._publish(*(await self._off(self.agent.close)))
            self.worker.shutdown(wait=False, cancel_futures=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rollouter [--config FILE] [KEY=VALUE ...]``."""
    cfg = load_or_exit(list(sys.argv[1:] if argv is None else argv), "rollouter")
    for key, value in (("redis.url", cfg.redis.url), ("run.id", cfg.run.id)):
        if not value:
            print(f"rollouter: error: invalid config key '{key}': required for a component "
                  "(rlbus up sets it for you)", file=sys.stderr)
            return 2
    return run_with_bus(
        cfg.redis.url or "", f"rollouter{cfg.rollout.rank}", lambda bus: Rollouter(cfg, bus).run()
    )
