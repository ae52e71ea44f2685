"""A batch's responses as they are generated (:class:`Seq`), and the samples they become
once scored (:func:`to_samples`): pure, no engine, no bus."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import msgspec
import numpy as np

from agent.conversation import AgentLimits, Dialogue, final_length
from rollouter.scoring import Score
from runschema.messages import Array, PromptTicket, Sample

__all__ = ["Seq", "to_samples"]


class Seq(msgspec.Struct):
    """One response being generated (possibly across weight versions)."""

    ticket: PromptTicket
    index: int
    prompt: list[int]
    tokens: list[int] = []
    logprobs: list[float] = []
    finished: bool = False
    min_version: int = -1
    max_version: int = -1
    dialogue: Dialogue | None = None
    """A multi-turn response's conversation (mask, turns, tool calls); None: single-turn."""


def to_samples(seqs: Sequence[Seq], scores: Sequence[Score], prompts: Mapping[str, list[int]],
               *, gen_s: float, rank: int, eos_id: int | None,
               fails_ticket: Callable[[PromptTicket], bool], ts: float | None = None,
               limits: AgentLimits | None = None
               ) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    """(samples by ticket id, errors by ticket id) for scored ``seqs``, generated in the
    ``gen_s`` seconds up to ``ts`` (None: now). A failed score fails
    its whole ticket where ``fails_ticket`` says so (rlbus's own reward function: the ticket
    is retried, then dead-lettered, without sinking its batch-mates); elsewhere a failed
    score is a sample like any other (verl's reward functions: reward 0)."""
    samples: dict[str, list[Sample]] = {}
    failed: dict[str, str] = {}
    # A ticket's n responses share its prompt: packed once.
    packed = {tid: Array.of(np.asarray(p, dtype=np.int32)) for tid, p in prompts.items()}
    for s, score in zip(seqs, scores, strict=True):
        tid = s.ticket.ticket_id
        if tid in failed:
            continue
        if score.failed and fails_ticket(s.ticket):
            failed[tid] = f"reward function failed: {score.error}"
            samples.pop(tid, None)
            continue
        samples.setdefault(tid, []).append(_sample(s, packed[tid], score, gen_s, rank, eos_id,
                                                   ts, limits))
    return samples, failed


def _sample(s: Seq, prompt: Array, score: Score, gen_s: float, rank: int,
            eos_id: int | None, ts: float | None, limits: AgentLimits | None) -> Sample:
    if s.dialogue is not None:
        return _conversation(s, prompt, score, gen_s, rank, eos_id, ts, limits)
    tid = s.ticket.ticket_id
    return Sample(
        sample_id=f"{tid}/{s.index}", ticket_id=tid,
        prompt_id=s.ticket.prompt_id, index=s.index, n=s.ticket.n,
        prompt_tokens=prompt,
        response_tokens=Array.of(np.asarray(s.tokens, dtype=np.int32)),
        logprobs=Array.of(np.asarray(s.logprobs, dtype=np.float32)),
        reward=score.reward, reward_s=score.seconds, reward_extra=score.extra,
        reward_error=(score.error or "reward function failed") if score.failed else "",
        reward_timed_out=score.timed_out,
        min_version=s.min_version, max_version=s.max_version, rank=rank,
        gen_time_s=gen_s, attempt=s.ticket.attempt,
        finish_reason="eos" if s.tokens and s.tokens[-1] == eos_id else "length",
        ts=time.time() if ts is None else ts,  # None: made now
    )


def _conversation(s: Seq, prompt: Array, score: Score, gen_s: float, rank: int,
                  eos_id: int | None, ts: float | None, limits: AgentLimits | None) -> Sample:
    """A multi-turn response's sample: every token after the prompt (assistant and tool
    turns) with its mask, cut to the response's budget as verl cuts it, and the
    conversation's counts."""
    d = s.dialogue
    assert d is not None
    keep = len(s.tokens) if limits is None else final_length(d, len(s.tokens), limits)
    cut = msgspec.structs.replace(s, tokens=s.tokens[:keep], logprobs=s.logprobs[:keep],
                                  dialogue=None)
    sample = _sample(cut, prompt, score, gen_s, rank, eos_id, ts, None)
    return msgspec.structs.replace(
        sample, response_mask=Array.of(np.asarray(d.mask[:keep], dtype=np.int8)),
        num_turns=d.num_turns, tool_calls=d.tool_calls, tool_failures=d.tool_failures,
        turn_versions=list(d.turn_versions))
