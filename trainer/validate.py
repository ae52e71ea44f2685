"""Checks a Sample against the ticket it claims to answer, before it is trained on.

Pure (numpy only). Anything a writer to Redis can append must be refused here with a reason,
never crash or stall the update: the trainer dead-letters a refused sample, with the rest of
its group (trainer.intake), and reissues its ticket. What is checked: the sample is one of
the ticket's responses (attempt, n, index, id), its arrays' kinds and lengths, token ids in
the vocabulary, log-probs finite and <= 0, its prompt the ticket's (the digest the ticket
carries), its reward finite and within ``reward.bounds``, its weights versions. Which
rollouter may answer is trainer.claims'.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from runschema.messages import Array, Sample, prompt_digest
from trainer.ledger import OpenTicket

__all__ = ["check_sample", "reward_problem", "values_in_range"]

_INT_KINDS = "iu"


def check_sample(
    s: Sample,
    ticket: OpenTicket,
    *,
    version: int,
    max_new_tokens: int,
    max_len: int | None = None,
    vocab_size: int | None = None,
    values_checked: bool = False,
    reward_bounds: tuple[float, float] | None = None,
    digest: str = "",
) -> str | None:
    """Why ``s`` cannot be trained as an answer of ``ticket`` while the trainer holds weights
    ``version``; None when it can. ``values_checked``: :func:`values_in_range` has shown
    for a batch holding ``s`` that its token ids and log-probs are in range;
    ``reward_bounds``: ``reward.bounds`` (None: any finite reward); ``digest``: the
    ticket's prompt digest (empty: not known, not checked)."""
    problem = _identity_problem(s, ticket)
    if problem is not None:
        return problem
    try:
        prompt = s.prompt_tokens.numpy()
        response = s.response_tokens.numpy()
        logprobs = s.logprobs.numpy()
    except (TypeError, ValueError) as exc:
        return f"undecodable token arrays: {exc}"
    return (_shape_problem(prompt, response, logprobs, max_new_tokens, max_len)
            or _mask_problem(s.response_mask, len(response))
            or _conversation_problem(s)
            or (None if values_checked else _value_problem(prompt, response, logprobs,
                                                            vocab_size))
            or _prompt_problem(s, digest)
            or reward_problem(s.reward, reward_bounds)
            or _version_problem(s, ticket, version))


def _prompt_problem(s: Sample, digest: str) -> str | None:
    """The sample's prompt is not the one its ticket was issued with: one hash of its
    prompt's bytes (a ticket's n responses share one prompt, so this is cheap)."""
    if digest and prompt_digest(s.prompt_tokens) != digest:
        return (f"its {len(s.prompt_tokens)} prompt tokens are not the prompt of "
                f"{s.ticket_id} (prompt digest check)")
    return None


def reward_problem(reward: float, bounds: tuple[float, float] | None) -> str | None:
    """A reward that is not finite, or outside ``bounds`` (``reward.bounds``): a finite
    but absurd reward (1e300) would swamp every advantage of its group and the step's
    ``critic/score/*`` metrics as surely as a NaN would poison them."""
    if not math.isfinite(reward):
        return f"reward {reward} is not finite (reward check)"
    if bounds is not None and not bounds[0] <= reward <= bounds[1]:
        return (f"reward {reward:g} outside reward.bounds [{bounds[0]:g}, {bounds[1]:g}] "
                "(reward check)")
    return None


def _identity_problem(s: Sample, ticket: OpenTicket) -> str | None:
    """The sample is not one of the ticket's responses (attempt, n, index, id)."""
    if s.attempt > ticket.attempt:
        return f"attempt {s.attempt} of {s.ticket_id} was never issued (latest {ticket.attempt})"
    if s.n != ticket.n:
        return f"n={s.n} but ticket {s.ticket_id} asked for n={ticket.n}"
    if not 0 <= s.index < ticket.n:
        return f"index {s.index} outside 0..{ticket.n - 1}"
    if s.sample_id != f"{s.ticket_id}/{s.index}":
        return f"sample id {s.sample_id!r} does not match ticket {s.ticket_id} index {s.index}"
    return None


def _shape_problem(prompt: np.ndarray, response: np.ndarray, logprobs: np.ndarray,
                   max_new_tokens: int, max_len: int | None) -> str | None:
    """Kinds and lengths of the arrays."""
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
    return None


def _mask_problem(mask: Array | None, tokens: int) -> str | None:
    """A response mask (multi-turn) of one 0/1 per response token, keeping one at least."""
    if mask is None:
        return None
    try:
        m = mask.numpy()
    except (TypeError, ValueError) as exc:
        return f"undecodable response mask: {exc}"
    if m.dtype.kind not in _INT_KINDS + "b" or len(m) != tokens:
        return f"a response mask of {len(m)} {m.dtype} values for {tokens} response tokens"
    if not np.isin(m, (0, 1)).all() or not m.any():
        return "a response mask must hold only 0 and 1, and train one token at least"
    return None


def _value_problem(prompt: np.ndarray, response: np.ndarray, logprobs: np.ndarray,
                   vocab_size: int | None) -> str | None:
    """Token ids inside the vocabulary, log-probs finite and <= 0."""
    if vocab_size is not None:
        lo = min(int(prompt.min()), int(response.min()))
        hi = max(int(prompt.max()), int(response.max()))
        if lo < 0 or hi >= vocab_size:
            return f"token ids span {lo}..{hi}, outside the vocabulary 0..{vocab_size - 1}"
    if not _logprobs_ok(logprobs):
        return "log-probs must be finite and <= 0"
    return None


def _conversation_problem(s: Sample) -> str | None:
    """A conversation's counts that contradict each other or its versions: a single
    response has none; a conversation has 2 turns at least, at most one assistant turn per
    turn after the prompt, versions per turn in order within its min..max, no more failed
    tool calls than calls, and a response mask once a tool answered."""
    if s.num_turns == 0:
        if s.tool_calls or s.tool_failures or s.turn_versions:
            return "tool calls or turn versions on a sample that is no conversation"
        return None
    v = s.turn_versions
    if s.num_turns < 2 or not 1 <= len(v) <= s.num_turns - 1:
        return f"{len(v)} assistant turns in a conversation of {s.num_turns} turns"
    if any(a > b for a, b in itertools.pairwise(v)) or not (
            s.min_version <= v[0] and v[-1] <= s.max_version):
        return (f"turn versions {v} out of order or outside {s.min_version}.."
                f"{s.max_version}")
    if not 0 <= s.tool_failures <= s.tool_calls:
        return f"{s.tool_failures} failed tool calls of {s.tool_calls}"
    if s.tool_calls and s.num_turns > len(v) + 1 and s.response_mask is None:
        return "a conversation with tool turns and no response mask"
    return None


def _version_problem(s: Sample, ticket: OpenTicket, version: int) -> str | None:
    """Weights versions between the ticket's and the trainer's."""
    # An older attempt's answer may still win; its own issue version is not kept, so only
    # the current attempt's lower bound is checked.
    low = ticket.version if s.attempt == ticket.attempt else 0
    if not low <= s.min_version <= s.max_version <= version:
        return (f"weights versions {s.min_version}..{s.max_version} outside "
                f"{low}..{version} (trainer holds {version})")
    return None


def _logprobs_ok(logprobs: np.ndarray) -> bool:
    # Two reductions: a NaN makes both NaN, an infinity shows at either end.
    return bool(math.isfinite(logprobs.min()) and logprobs.max() <= 1e-4)


def values_in_range(samples: Sequence[Sample], vocab_size: int | None) -> bool:
    """Whether every token id of ``samples`` lies in 0..vocab_size - 1 and every log-prob is
    finite and <= 0, shown over the whole batch at once: one concatenation and a few
    reductions per kind instead of six reductions per sample (a read of 256 samples costs
    ~0.3 ms instead of ~2.5 ms of the trainer's event loop).

    False when it cannot be shown this way: a value out of range, token ids or log-probs of
    more than one dtype (or of the wrong kind, or one numpy does not know), a buffer that
    is not a whole number of items (concatenated, it would shift the items of the samples
    after it). Then :func:`check_sample` checks each sample's values on its own and names
    the culprit."""
    if not samples:
        return True
    tok_str, lp_str = samples[0].prompt_tokens.dtype, samples[0].logprobs.dtype
    try:
        tok_dtype, lp_dtype = np.dtype(tok_str), np.dtype(lp_str)
    except (TypeError, ValueError):  # a dtype numpy does not know: check_sample names it
        return False
    if tok_dtype.kind not in _INT_KINDS or lp_dtype.kind != "f":
        return False
    tok_size, lp_size = tok_dtype.itemsize, lp_dtype.itemsize
    for s in samples:
        p, r, lp = s.prompt_tokens, s.response_tokens, s.logprobs
        if (p.dtype != tok_str or r.dtype != tok_str or lp.dtype != lp_str
                or len(p.data) % tok_size or len(r.data) % tok_size or len(lp.data) % lp_size):
            return False
    tokens = np.frombuffer(b"".join(x for s in samples
                                    for x in (s.prompt_tokens.data, s.response_tokens.data)),
                           dtype=tok_dtype)
    logprobs = np.frombuffer(b"".join(s.logprobs.data for s in samples), dtype=lp_dtype)
    if vocab_size is not None and tokens.size and (int(tokens.min()) < 0
                                                   or int(tokens.max()) >= vocab_size):
        return False
    return not logprobs.size or _logprobs_ok(logprobs)
