"""Checks a Sample against the ticket it claims to answer, before it is trained on.

Pure (numpy only). Anything a writer to Redis can append must be refused here with a reason,
never crash or stall the update: the trainer dead-letters a refused sample and reissues its
ticket.
"""

from __future__ import annotations

import math

from bus.messages import Sample
from trainer.ledger import OpenTicket

__all__ = ["check_sample"]

_INT_KINDS = "iu"


def check_sample(
    s: Sample,
    ticket: OpenTicket,
    *,
    version: int,
    max_new_tokens: int,
    max_len: int | None = None,
    vocab_size: int | None = None,
) -> str | None:
    """Why ``s`` cannot be trained as an answer of ``ticket`` while the trainer holds weights
    ``version``; None when it can."""
    if s.attempt > ticket.attempt:
        return f"attempt {s.attempt} of {s.ticket_id} was never issued (latest {ticket.attempt})"
    if s.n != ticket.n:
        return f"n={s.n} but ticket {s.ticket_id} asked for n={ticket.n}"
    if not 0 <= s.index < ticket.n:
        return f"index {s.index} outside 0..{ticket.n - 1}"
    if s.sample_id != f"{s.ticket_id}/{s.index}":
        return f"sample id {s.sample_id!r} does not match ticket {s.ticket_id} index {s.index}"
    try:
        prompt = s.prompt_tokens.numpy()
        response = s.response_tokens.numpy()
        logprobs = s.logprobs.numpy()
    except (TypeError, ValueError) as exc:
        return f"undecodable token arrays: {exc}"
    if prompt.dtype.kind not in _INT_KINDS or response.dtype.kind not in _INT_KINDS:
        return f"token ids must be integers, got {prompt.dtype} / {response.dtype}"
    if logprobs.dtype.kind != "f":
        return f"log-probs must be floats, got {logprobs.dtype}"
    if len(prompt) == 0 or len(response) == 0:
        return f"empty prompt or response ({len(prompt)} / {len(response)} tokens)"
    if len(response) > max_new_tokens:
        return f"{len(response)} response tokens, more than rollout.max_new_tokens={max_new_tokens}"
    if max_len is not None and len(prompt) + len(response) > max_len:
        return f"{len(prompt) + len(response)} tokens, more than the model's max_len={max_len}"
    if len(logprobs) != len(response):
        return f"{len(logprobs)} log-probs for {len(response)} response tokens"
    if vocab_size is not None:
        lo = min(int(prompt.min()), int(response.min()))
        hi = max(int(prompt.max()), int(response.max()))
        if lo < 0 or hi >= vocab_size:
            return f"token ids span {lo}..{hi}, outside the vocabulary 0..{vocab_size - 1}"
    # Two reductions: a NaN makes both NaN, an infinity shows at either end.
    if not (math.isfinite(logprobs.min()) and logprobs.max() <= 1e-4):
        return "log-probs must be finite and <= 0"
    if not math.isfinite(s.reward):
        return f"reward {s.reward} is not finite"
    # An older attempt's answer may still win; its own issue version is not kept, so only
    # the current attempt's lower bound is checked.
    low = ticket.version if s.attempt == ticket.attempt else 0
    if not low <= s.min_version <= s.max_version <= version:
        return (f"weights versions {s.min_version}..{s.max_version} outside "
                f"{low}..{version} (trainer holds {version})")
    return None
