"""The pure checks of a sample against its ticket (issue 36): the prompt digest, the reward's
bounds, the holder's claim (trainer.validate, trainer.claims, runschema.messages)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from runschema.messages import Array, Sample, TicketsClaimed, prompt_digest
from trainer.claims import Claims
from trainer.validate import reward_problem

BOUNDS = (-1e6, 1e6)
ids = st.lists(st.integers(0, 2**31 - 1), max_size=40)


@given(ids, ids)
def test_a_prompt_digest_tells_prompts_apart_whatever_their_int_width(a: list[int],
                                                                      b: list[int]) -> None:
    packed = Array.of(np.asarray(a, dtype=np.int32))
    assert prompt_digest(packed) == prompt_digest(a)
    assert prompt_digest(Array.of(np.asarray(a, dtype=np.int64))) == prompt_digest(a)
    assert (prompt_digest(a) == prompt_digest(b)) == (a == b)


def test_ids_outside_int32_have_no_digest_a_ticket_carries() -> None:
    assert prompt_digest([2**31]) == "out of range" != prompt_digest([0])
    assert prompt_digest(Array.of(np.asarray([0.5], dtype=np.float32))) == "out of range"


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_reward_is_refused_exactly_when_not_finite_or_out_of_bounds(r: float) -> None:
    refused = reward_problem(r, BOUNDS) is not None
    assert refused == (not math.isfinite(r) or not BOUNDS[0] <= r <= BOUNDS[1])
    assert (reward_problem(r, None) is not None) == (not math.isfinite(r))


def _sample(tid: str, attempt: int, rank: int) -> Sample:
    arr = Array.of(np.asarray([1], dtype=np.int32))
    return Sample(sample_id=f"{tid}/0", ticket_id=tid, prompt_id="p", index=0, n=1,
                  prompt_tokens=arr, response_tokens=arr,
                  logprobs=Array.of(np.asarray([-1.0], dtype=np.float32)), reward=0.0,
                  min_version=0, max_version=0, attempt=attempt, rank=rank)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 3)),
                max_size=20),
       st.integers(0, 3), st.integers(0, 2), st.integers(0, 3))
def test_only_a_claimer_of_a_watched_attempt_may_answer_it(
        claims: list[tuple[int, int, int]], ticket: int, attempt: int, rank: int) -> None:
    """Issued: attempts 0 and 1 of tickets 0-2 (ticket 3 and attempt 2: not watched).
    A sample passes iff its attempt is not watched or its rank claimed that attempt."""
    book = Claims()
    for t in range(3):
        for a in (0, 1):
            book.issued(t, a)
    for t, a, r in claims:
        book.claimed(TicketsClaimed(ticket_ids=[f"t{t}"], attempts=[a], rank=r))
    watched = ticket < 3 and attempt < 2
    ok = not watched or (ticket, attempt, rank) in claims
    assert (book.problem(_sample(f"t{ticket}", attempt, rank)) is None) == ok
    book.forget([ticket])
    assert book.problem(_sample(f"t{ticket}", attempt, rank)) is None


def test_a_multi_turn_response_mask_is_checked_before_it_trains() -> None:
    """verl's response mask (0: a tool's output, never trained) must give one 0/1 per
    response token and keep one at least; a sample without one trains every token."""
    import msgspec

    from trainer.ledger import OpenTicket
    from trainer.validate import check_sample

    ticket = OpenTicket(index=0, n=1, attempt=0, version=0)
    three = Array.of(np.asarray([5, 6, 7], dtype=np.int32))
    base = msgspec.structs.replace(_sample("t0", 0, 0), response_tokens=three,
                                   logprobs=Array.of(np.full(3, -1.0, dtype=np.float32)))

    def problem(mask: list[int] | None, dtype: str = "int8") -> str | None:
        packed = None if mask is None else Array.of(np.asarray(mask, dtype=dtype))
        return check_sample(msgspec.structs.replace(base, response_mask=packed), ticket,
                            version=0, max_new_tokens=8)

    assert problem(None) is None and problem([1, 0, 1]) is None
    assert problem([1, 1, 1], "bool") is None
    assert "2 int8 values for 3 response tokens" in (problem([1, 0]) or "")
    assert "only 0 and 1" in (problem([1, 2, 0]) or "")
    assert "train one token at least" in (problem([0, 0, 0]) or "")
    assert "for 3 response tokens" in (problem([1.0, 0.0, 1.0], "float32") or "")


def test_a_conversations_counts_that_contradict_each_other_are_refused() -> None:
    """A conversation's turns, tool calls and versions per turn (rollout.multi_turn) must
    agree with each other and with the sample's versions; a single response has none."""
    import msgspec

    from trainer.ledger import OpenTicket
    from trainer.validate import check_sample

    ticket = OpenTicket(index=0, n=1, attempt=0, version=0)
    three = Array.of(np.asarray([5, 6, 7], dtype=np.int32))
    base = msgspec.structs.replace(_sample("t0", 0, 0), response_tokens=three,
                                   logprobs=Array.of(np.full(3, -1.0, dtype=np.float32)),
                                   min_version=0, max_version=1,
                                   response_mask=Array.of(np.asarray([1, 0, 1], np.int8)))

    def problem(**fields: object) -> str | None:
        return check_sample(msgspec.structs.replace(base, **fields), ticket, version=1,
                            max_new_tokens=8)

    good = {"num_turns": 4, "tool_calls": 1, "tool_failures": 0, "turn_versions": [0, 1]}
    assert problem(**good) is None
    assert problem() is None  # a single response
    assert "no conversation" in (problem(tool_calls=1) or "")
    assert "assistant turns" in (problem(**{**good, "turn_versions": [0, 1, 1, 1]}) or "")
    assert "out of order" in (problem(**{**good, "turn_versions": [1, 0]}) or "")
    assert "outside 0..1" in (problem(**{**good, "turn_versions": [0, 2]}) or "")
    assert "failed tool calls" in (problem(**{**good, "tool_failures": 2}) or "")
    assert "no response mask" in (problem(**good, response_mask=None) or "")
