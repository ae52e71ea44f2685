"""The rollouter's loop on the built-in engine (``rollout.name=hf``): tickets in batches.

Each batch is ``rollout.prompts_per_batch`` tickets claimed together, generated in one
:meth:`~rollouter.engine.Engine.generate` call (or, with ``async_training.partial_rollout``,
in chunks of ``rollout.partial_chunk_tokens`` between which new weights are loaded: a
sample's min and max versions then differ), scored, and published with the acks of its
tickets while the next batch generates. New weights are loaded between batches, at once
when a ticket needs them; validation requests are served as soon as they are read, before
the next batch and before newer weights load (so the before-training validation is of the
initial model, as on vLLM).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import NamedTuple

from bus import Delivery
from rollouter.answers import Seq, to_samples
from rollouter.context import RolloutContext
from rollouter.engine import Engine
from rollouter.tickets import Ticket
from runschema.messages import PromptTicket, Sample
from runtime import Failure

__all__ = ["BatchRollout", "Generated"]


class Generated(NamedTuple):
    """A batch's responses, decoded, before their rewards: the sequences, their texts, the
    prompts' ids by ticket, the generation's seconds and its end (wall clock)."""

    seqs: list[Seq]
    texts: list[str]
    prompts: dict[str, list[int]]
    gen_s: float
    ended: float


class BatchRollout:
    """Serve ``ctx``'s tickets a batch at a time on ``engine`` until the run finishes
    (a :class:`~rollouter.context.RolloutLoop`)."""

    def __init__(self, ctx: RolloutContext, engine: Engine) -> None:
        self.ctx, self.engine = ctx, engine
        self.eos_ids = ctx.eos_ids(engine)
        self.last_reclaim = time.monotonic()

    def describe(self) -> str | None:
        """Nothing beyond the weights the heartbeat names already."""
        return None

    async def run(self) -> None:
        """Until the run's end: every batch's tickets delivered once, or retried, or
        dead-lettered; when there is nothing to do, the log, new weights, the trainer's
        health and, every heartbeat interval, the tickets of dead replicas."""
        ctx, laps = self.ctx, self.ctx.laps
        while not ctx.finished:
            deliveries, polled = await ctx.tickets.next()
            laps.lap("idle")  # waiting for tickets (a read ahead brought them, or a read)
            if not deliveries:
                await ctx.events.poll()
                await self.validate()
                await ctx.weights.swap(wait=False)
                if ctx.finished:
                    laps.lap("idle")
                    break
                await ctx.trainer.check()
                deliveries, polled = await self._reclaim(), False
                laps.lap("idle")
                if not deliveries:
                    continue
            await self.serve(deliveries, polled)
            await ctx.validations.serve(self.engine)
            laps.lap("validate")

    async def validate(self) -> None:
        """Serve the validation requests read so far on the weights the engine holds, before
        newer ones are loaded: a request names the weights it wants (newer are allowed), and
        the before-training one (v0) then validates the initial model, as on vLLM's emptied
        engine, not the first update's."""
        if self.ctx.tickets.validations_waiting:
            await self.ctx.validations.serve(self.engine)
            self.ctx.laps.lap("validate")

    async def _reclaim(self) -> list[Delivery]:
        if time.monotonic() - self.last_reclaim <= self.ctx.cfg.heartbeat.interval_s:
            return []
        self.last_reclaim = time.monotonic()
        return await self.ctx.tickets.reclaim_from_dead_replicas()

    async def serve(self, deliveries: list[Delivery], polled: bool = False) -> None:
        """Generate for ``deliveries``' tickets and publish the answers; ``polled``: the
        events stream was read after these tickets were (rollouter.tickets)."""
        ctx, laps = self.ctx, self.ctx.laps
        await self.validate()
        accepted = await ctx.tickets.accept(deliveries)
        laps.lap("claim")
        tickets = await ctx.weights.for_tickets(deliveries, accepted)  # new weights they need
        laps.lap("weights")
        if not tickets:
            return
        # These tickets were issued after the StepFinished that begins the step they belong
        # to: read it now, so that their generation lands in that step (profiling.steps).
        if not polled:
            await ctx.events.poll()
        laps.lap("events")
        if ctx.finished:
            return
        await ctx.weights.swap(wait=False)
        laps.lap("weights")
        if not ctx.finished:
            ctx.tickets.prefetch()
        try:
            generated = await self.rollout([t for _, t in tickets])
        except Failure:
            raise  # the engine is broken (EngineBroken): this rollouter's named end
        except Exception as exc:  # a failed rollout is an event, never "end of data"
            error = f"generation failed: {type(exc).__name__}: {exc}"
            await ctx.tickets.retry_or_give_up(deliveries, {t.ticket_id: error
                                                            for _, t in tickets})
            laps.lap("publish")
            return
        # Scored and published in the background while the next batch generates; this
        # waits for the batch before (one in flight).
        await ctx.tickets.deliver_later(self.answers(deliveries, tickets, generated))
        laps.lap("publish")

    async def rollout(self, tickets: Sequence[PromptTicket]) -> Generated:
        """Generate every ticket's responses and decode them (on the worker, before the
        next batch's generation is queued there)."""
        ctx = self.ctx
        # A ticket's n responses share its prompt: encoded once.
        prompts = {t.ticket_id: ctx.prompt_ids(t) for t in tickets}
        seqs = [Seq(t, i, prompts[t.ticket_id], [], []) for t in tickets for i in range(t.n)]
        if ctx.conversations is not None:
            seqs = [ctx.conversations.start(s) for s in seqs]
        t0 = time.monotonic()
        await self.generate_all(seqs)
        ended = time.time()
        gen_s = time.monotonic() - t0
        ctx.idle.add(gen_s)
        ctx.laps.lap("generate")
        texts = await ctx.scorer.decode(seqs)
        ctx.laps.lap("score")
        return Generated(seqs, texts, prompts, gen_s, ended)

    async def answers(self, deliveries: list[Delivery], tickets: Sequence[Ticket],
                      generated: Generated) -> tuple[list[Ticket], dict[str, list[Sample]]]:
        """In the background: the generated responses scored (the reward pool's threads)
        and made samples; failed tickets retried or dead-lettered. The tickets answered and
        their samples, to publish."""
        ctx, (seqs, texts, prompts, gen_s, ended) = self.ctx, generated
        scores = await ctx.scorer.score_items(ctx.scorer.items(seqs, texts))
        samples, failed = to_samples(seqs, scores, prompts, gen_s=gen_s, rank=ctx.rank,
                                     eos_id=ctx.tokenizer.eos_id,
                                     fails_ticket=ctx.scorer.fails_ticket, ts=ended,
                                     limits=ctx.agent_limits)
        await ctx.tickets.retry_or_give_up(deliveries, failed)
        return [(i, t) for i, t in tickets if t.ticket_id in samples], samples

    async def generate_all(self, seqs: list[Seq]) -> None:
        """Every sequence to its end; a conversation (rollout.multi_turn) turn by turn: the
        batch's turns generated together, then every conversation whose turn called tools
        runs them (all at once, on the tool threads), then the next turns."""
        await self.generate_turn(seqs)
        talks = self.ctx.conversations
        if talks is None:
            return
        while True:
            turned = [s for s in seqs if s.dialogue is not None and not s.dialogue.over]
            if not turned:
                return
            # A sync waits for turns, not for whole conversations: weights published by now
            # are fetched while the tools run, and loaded before the next turns.
            await self.ctx.events.poll()
            going = await asyncio.gather(*(talks.after_turn(s) for s in turned))
            if any(going):
                await self.ctx.weights.swap(wait=False)
                await self.generate_turn(seqs)

    async def generate_turn(self, seqs: list[Seq]) -> None:
        """Every sequence to the end of its turn; with ``partial_rollout``, in chunks between
        which new weights are picked up mid-turn."""
        ctx, rc = self.ctx, self.ctx.cfg.rollout
        if not ctx.cfg.async_training.partial_rollout:
            # A conversation's later turns have what its earlier ones left of the budget.
            left = rc.max_new_tokens - min((len(s.tokens) for s in seqs if not s.finished),
                                           default=0)
            await ctx.off(self.generate, seqs, left)
            return
        while any(not s.finished for s in seqs):
            left = rc.max_new_tokens - min(len(s.tokens) for s in seqs if not s.finished)
            await ctx.off(self.generate, seqs, min(rc.partial_chunk_tokens, left))
            await ctx.events.poll()
            await ctx.weights.swap(wait=False)

    def generate(self, seqs: list[Seq], max_tokens: int) -> None:
        """On the worker thread: extend every unfinished sequence by up to ``max_tokens``
        with the weights the engine holds."""
        rc = self.ctx.cfg.rollout
        live = [s for s in seqs if not s.finished]
        if not live:
            return
        out = self.engine.generate(
            [s.prompt + s.tokens for s in live], max_new_tokens=max_tokens,
            temperature=rc.temperature, eos_id=self.eos_ids, generator=self.ctx.generator,
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
