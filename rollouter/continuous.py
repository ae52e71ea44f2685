"""The rollouter's loop on a streaming engine (``rollout.name=vllm``): continuous admission.

Each ticket's ``n`` responses go into the running engine as soon as the ticket is claimed
(within the engine's ``rollout.max_num_seqs``), not in fixed batches; a ticket is scored
and published, with the ack of its entry, as soon as its last response ends, while the
engine generates the others. Between two slices of engine steps the loop reads the log
(weights, the trainer's step boundaries for profiling, the run's end), claims tickets and
decides, by :func:`rollouter.admission.sync_action`, whether the engine must be emptied:

- newer weights fetched and ready, or claimed tickets that need them: with
  ``async_training.partial_rollout`` the running responses are aborted, the weights loaded
  and every response resumed from its tokens so far (its ``min_version`` < ``max_version``);
  without, nothing new is admitted until the running responses end on their weights;
- validation requests: served on the empty engine, then generation goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from bus import Delivery
from rollouter.admission import Action, Admission, Group, sync_action
from rollouter.answers import Seq, to_samples
from rollouter.context import RolloutContext
from rollouter.engine import Delta, StreamingEngine
from runschema.messages import PromptTicket, Sample
from runtime import Failure

__all__ = ["SLICE_STEPS", "ContinuousRollout"]

SLICE_STEPS = 8  # engine steps between two looks at the log (fewer when a response ends)
CHECK_S = 1.0  # the trainer's lease is checked at most this often
TURN_WAIT_S = 0.2  # every conversation in its tools: the longest wait for tickets or one back


class ContinuousRollout:
    """Serve ``ctx``'s tickets on the streaming ``engine`` until the run finishes (a
    :class:`~rollouter.context.RolloutLoop`)."""

    def __init__(self, ctx: RolloutContext, engine: StreamingEngine) -> None:
        self.ctx, self.engine = ctx, engine
        rc = ctx.cfg.rollout
        self.partial = ctx.cfg.async_training.partial_rollout
        self.capacity = rc.max_num_seqs
        self.eos_ids = ctx.eos_ids(engine)
        self.book = Admission(rc.max_new_tokens)
        self.waiting: list[tuple[Delivery, PromptTicket]] = []  # claimed, not yet admitted
        self.resume: list[tuple[str, Seq]] = []  # aborted at a sync: submitted again
        self.returning: list[tuple[str, Seq]] = []  # conversations' next turns, to submit
        self.talking: set[asyncio.Task[None]] = set()  # conversations' tool turns running
        self.turn_back = asyncio.Event()  # a tool turn returned (the idle wait ends on it)
        self.done: list[Group] = []  # ended, to score and publish
        self.finishing: asyncio.Task[None] | None = None
        self.checked = self.reclaimed = time.monotonic()

    def describe(self) -> str:
        """What the engine is doing, for the heartbeat's state."""
        talking = f", {len(self.talking)} conversations in their tools" if self.talking else ""
        return (f"{self.book.seqs} responses of {len(self.book.groups)} tickets in the engine, "
                f"{len(self.waiting)} tickets waiting{talking}")

    async def run(self) -> None:
        """Until the run's end: every ticket delivered once, or retried, or dead-lettered."""
        try:
            laps = self.ctx.laps
            while not self.ctx.finished:
                await self._claim()
                laps.lap("claim" if self.waiting or self.engine.in_flight else "idle")
                admitting = await self._sync()
                laps.lap("weights")
                if self.ctx.finished:
                    break
                await self._generate(self._admit() if admitting else [])
                laps.lap("generate")
                await self._drop_superseded()
                await self._finish()
                laps.lap("publish")
                await self._look_around()
                laps.lap("events")
            await self.ctx.off(self.engine.abort)  # the run ended: what runs is not needed
            await self._finish(wait=True)
        finally:
            for task in self.talking:
                task.cancel()
            if self.finishing is not None and not self.finishing.done():
                self.finishing.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self.finishing

    # ------------------------------------------------------------------ tickets in

    async def _claim(self) -> None:
        """Claim tickets while the engine has room: what the read ahead brought, or, with
        nothing to generate, a read that waits up to 200 ms."""
        desk = self.ctx.tickets
        queued = self.book.seqs + sum(t.n for _, t in self.waiting)
        if queued >= self.capacity:
            return
        busy = queued > 0 or self.engine.in_flight > 0
        if busy and not desk.has_ready():
            desk.prefetch()
            return
        if not busy and self.talking and not desk.has_ready():
            # Every conversation is in its tools: tickets, or the first to come back.
            if not await desk.ready_within(self.turn_back, TURN_WAIT_S):
                return
        self.turn_back.clear()
        deliveries, _ = await desk.next()
        if not deliveries and not busy:
            deliveries = await self._reclaim()
        by_id = {d.id: d for d in deliveries}
        self.waiting += [(by_id[d_id], t) for d_id, t in await desk.accept(deliveries)]

    async def _reclaim(self) -> list[Delivery]:
        """Idle: tickets pending on dead replicas, every heartbeat interval."""
        if time.monotonic() - self.reclaimed <= self.ctx.cfg.heartbeat.interval_s:
            return []
        self.reclaimed = time.monotonic()
        return await self.ctx.tickets.reclaim_from_dead_replicas()

    def _admit(self) -> list[tuple[str, Seq]]:
        """The responses to submit now: those aborted at a sync first, then the waiting
        tickets in claim order while the engine has room (at least one when it is empty)."""
        out, self.resume, self.returning = self.resume + self.returning, [], []
        while self.waiting:
            delivery, ticket = self.waiting[0]
            if ticket.min_version > self.ctx.weights.version:
                break  # the next sync loads what it needs
            if self.book.seqs + ticket.n > self.capacity and self.book.seqs > 0:
                break
            self.waiting.pop(0)
            opened = self.book.open(delivery, ticket, self.ctx.prompt_ids(ticket), time.time())
            if self.ctx.conversations is not None:
                opened = [(k, self.ctx.conversations.start(s)) for k, s in opened]
            out += opened
        return out

    async def _drop_superseded(self) -> None:
        """Ack the entries of the attempts a newer attempt of their ticket replaced in the
        engine (Admission.open): nobody waits for their answer any more."""
        if self.book.superseded:
            gone, self.book.superseded = self.book.superseded, []
            await self.ctx.tickets.source.ack(*(g.delivery for g in gone))

    # ------------------------------------------------------------------ weights

    async def _sync(self) -> bool:
        """Empty the engine when it must be (:func:`sync_action`) and, once it is, load the
        weights and serve the validations waiting. Returns whether tickets may be admitted."""
        ctx = self.ctx
        need = max((t.min_version for _, t in self.waiting), default=-1)
        action = sync_action(self.engine.in_flight, partial=self.partial,
                             newer_ready=ctx.weights.ready(),
                             must_sync=need > ctx.weights.version,
                             validations=ctx.tickets.validations_waiting)
        if action is Action.GO:
            return True
        if action is Action.DRAIN:
            return False
        if action is Action.ABORT:
            self._apply(await ctx.off(self.engine.abort))
            # Every response running or about to run its next turn: all resumed after it.
            self.resume, self.returning = self.book.resumable(), []
        if need > ctx.weights.version:
            served = await ctx.weights.for_tickets(
                [d for d, _ in self.waiting], [(d.id, t) for d, t in self.waiting])
            kept = {d_id for d_id, _ in served}
            self.waiting = [(d, t) for d, t in self.waiting if d.id in kept]
        else:
            await ctx.weights.swap(wait=False)
        await ctx.validations.serve(self.engine)
        return True

    # ------------------------------------------------------------------ generation

    async def _generate(self, submissions: list[tuple[str, Seq]]) -> None:
        """Submit ``submissions`` and run one slice of engine steps (on the worker thread);
        a failed slice fails every ticket in the engine (retried, then dead-lettered)."""
        if not submissions and self.engine.in_flight == 0:
            return
        began = time.monotonic()
        cancelled, self.book.cancelled = self.book.cancelled, []
        try:
            failed, deltas = await self.ctx.off(self._slice, submissions, cancelled)
        except Failure:
            raise  # the engine is broken (EngineBroken): this rollouter's named end
        except Exception as exc:  # a failed rollout is an event, never "end of data"
            with contextlib.suppress(Exception):
                await self.ctx.off(self.engine.abort)
            error = f"generation failed: {type(exc).__name__}: {exc}"
            failed, deltas = {tid: error for tid in self.book.groups}, []
        self.ctx.idle.add(time.monotonic() - began)
        self._apply(deltas)
        if failed:
            groups = self.book.drop(failed)
            await self.ctx.tickets.retry_or_give_up([g.delivery for g in groups], failed)

    def _slice(self, submissions: list[tuple[str, Seq]], cancelled: list[str]
               ) -> tuple[dict[str, str], list[Delta]]:
        """On the worker thread: end the ``cancelled`` responses (superseded attempts:
        Admission.open), submit each response (a ticket whose prompt the engine refuses
        fails alone), then up to :data:`SLICE_STEPS` engine steps."""
        ctx, rc = self.ctx, self.ctx.cfg.rollout
        if cancelled:
            self.engine.cancel(cancelled)
        failed: dict[str, str] = {}
        for key, seq in submissions:
            tid = seq.ticket.ticket_id
            if tid in failed:
                continue
            try:
                self.engine.submit(key, seq.prompt + seq.tokens,
                                   rc.max_new_tokens - len(seq.tokens), rc.temperature,
                                   self.eos_ids, generator=ctx.generator, top_p=rc.top_p,
                                   top_k=rc.top_k)
            except ValueError as exc:
                failed[tid] = f"generation failed: {exc}"
        return failed, self.engine.advance(SLICE_STEPS) if self.engine.in_flight else []

    def _apply(self, deltas: list[Delta]) -> None:
        """Fold what the engine generated (with the weights it holds) into the tickets; a
        conversation whose turn ended goes to its tools (:meth:`_tool_turn`), the engine
        generating for the others meanwhile."""
        self.done += self.book.apply(deltas, self.engine.version, time.time())
        turned, self.book.turned = self.book.turned, []
        for ticket_id, seq in turned:
            task = asyncio.create_task(self._tool_turn(ticket_id, seq))
            self.talking.add(task)
            task.add_done_callback(self.talking.discard)

    async def _tool_turn(self, ticket_id: str, seq: Seq) -> None:
        """A conversation between two turns: its tools run (rollouter.conversations); then
        its next turn joins the engine, or its ticket is done once its last response is. A
        ticket dropped meanwhile (failed, or a newer attempt admitted) is left alone; a turn
        that cannot be made (the tool turn fails to render) fails its ticket."""
        assert self.ctx.conversations is not None
        try:
            going = await self.ctx.conversations.after_turn(seq)
        except Exception as exc:
            if self.book.holds(ticket_id, seq):
                groups = self.book.drop([ticket_id])
                await self.ctx.tickets.retry_or_give_up(
                    [g.delivery for g in groups],
                    {ticket_id: f"tool turn failed: {type(exc).__name__}: {exc}"})
            return
        finally:
            self.turn_back.set()  # back from its tools either way: the idle wait may end
        if not self.book.holds(ticket_id, seq):
            return
        if going:
            self.returning.append(self.book.rejoin(ticket_id, seq))
            return
        ended = self.book.conclude(ticket_id, time.time())
        if ended is not None:
            self.done.append(ended)

    # ------------------------------------------------------------------ tickets out

    async def _finish(self, wait: bool = False) -> None:
        """Score and publish the tickets that ended, one publication at a time in the
        background (the engine generates meanwhile); ``wait``: until all are out."""
        while True:
            if self.finishing is not None:
                if not (wait or self.finishing.done()):
                    return
                task, self.finishing = self.finishing, None
                await task  # its failure is this loop's
            if not self.done:
                return
            groups, self.done = self.done, []
            self.finishing = asyncio.create_task(self._publish(groups))
            if not wait:
                return

    async def _publish(self, groups: list[Group]) -> None:
        ctx = self.ctx
        scores = await ctx.scorer.score([s for g in groups for s in g.seqs])
        at = 0
        samples: dict[str, list[Sample]] = {}
        failed: dict[str, str] = {}
        for g in groups:
            part = scores[at:at + len(g.seqs)]
            at += len(g.seqs)
            # Tickets overlap in the engine: each sample says when its ticket ran (from
            # ts - gen_time_s to ts), so timing_s/gen counts the wall time once.
            ok, bad = to_samples(g.seqs, part, {g.ticket_id: g.prompt},
                                 gen_s=g.ended - g.began, rank=ctx.rank,
                                 eos_id=ctx.tokenizer.eos_id,
                                 fails_ticket=ctx.scorer.fails_ticket, ts=g.ended)
            samples.update(ok)
            failed.update(bad)
        await ctx.tickets.retry_or_give_up([g.delivery for g in groups], failed)
        await ctx.tickets.deliver([(g.delivery.id, g.ticket) for g in groups
                                 if g.ticket_id in samples], samples)

    # ------------------------------------------------------------------ the rest

    async def _look_around(self) -> None:
        """The log (weights, step boundaries, the run's end) after every slice; the
        trainer's lease every :data:`CHECK_S`."""
        await self.ctx.events.poll()
        if time.monotonic() - self.checked >= CHECK_S:
            self.checked = time.monotonic()
            await self.ctx.trainer.check()
