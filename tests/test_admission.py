"""Continuous admission's bookkeeping (rollouter.admission): which tickets are done, with
which weights each response was generated, and when the engine is emptied. Pure: no engine,
no Redis."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from rollouter.admission import Action, Admission, sync_action
from rollouter.engine import Delta
from runschema.messages import PromptTicket


def _ticket(tid: str, n: int) -> PromptTicket:
    return PromptTicket(ticket_id=tid, prompt_id=f"p-{tid}", prompt="", answer="", n=n,
                        min_version=0)


def _delta(key: str, tokens: list[int], finished: bool = False) -> Delta:
    return Delta(key, tokens, [-0.5] * len(tokens), finished)


def test_a_ticket_is_done_when_its_last_response_ends() -> None:
    book = Admission(max_new_tokens=4)
    keyed = book.open("d1", _ticket("a", 2), [1, 2], now=10.0)
    assert [k for k, _ in keyed] == ["a#0/0", "a#0/1"] and book.seqs == 2
    book.open("d2", _ticket("b", 1), [1, 3], now=11.0)
    assert book.apply([_delta("a#0/0", [5], finished=True), _delta("b#0/0", [6, 7])], 0, 12.0) == []
    # b/0 reaches max_new_tokens (4) without an eos: ended; a/1 ends with its eos.
    done = book.apply([_delta("b#0/0", [8, 9]), _delta("a#0/1", [4, 2], finished=True)], 1, 13.0)
    assert [g.ticket_id for g in done] == ["b", "a"]
    b, a = done
    assert b.seqs[0].tokens == [6, 7, 8, 9] and b.seqs[0].finished
    assert (b.seqs[0].min_version, b.seqs[0].max_version) == (0, 1)
    assert (a.seqs[0].min_version, a.seqs[0].max_version) == (0, 0)
    assert (a.seqs[1].min_version, a.seqs[1].max_version) == (1, 1)
    assert (a.began, a.ended, b.began, b.ended) == (10.0, 13.0, 11.0, 13.0)
    assert book.seqs == 0 and book.groups == {}
    # What arrives for a ticket no longer tracked is ignored.
    assert book.apply([_delta("a#0/0", [1], finished=True)], 2, 14.0) == []


def test_aborted_responses_resume_and_dropped_tickets_are_forgotten() -> None:
    book = Admission(max_new_tokens=8)
    book.open("d1", _ticket("a", 2), [1], now=0.0)
    book.open("d2", _ticket("b", 1), [1], now=0.0)
    book.apply([_delta("a#0/0", [3], finished=True), _delta("a#0/1", [4]), _delta("b#0/0", [5])],
               0, 1.0)
    assert {k: s.tokens for k, s in book.resumable()} == {"a#0/1": [4], "b#0/0": [5]}
    (dropped,) = book.drop(["b", "missing"])
    assert dropped.ticket_id == "b" and [k for k, _ in book.resumable()] == ["a#0/1"]
    assert book.apply([_delta("b#0/0", [6], finished=True)], 1, 2.0) == []
    (a,) = book.apply([_delta("a#0/1", [7], finished=True)], 1, 2.0)
    assert a.seqs[1].tokens == [4, 7] and (a.seqs[1].min_version, a.seqs[1].max_version) == (0, 1)


def test_a_newer_attempt_of_a_running_ticket_replaces_it() -> None:
    """The trainer reissued ``a`` (attempt 1) and this rollouter claimed it while attempt 0
    still runs: attempt 1 is admitted under keys of its own (no running key is reused), the
    older group is dropped and waits for its ack, and what the engine still reports for it is
    ignored. An older attempt arriving late replaces nothing."""
    book = Admission(max_new_tokens=4)
    book.open("d0", _ticket("a", 2), [1], now=0.0)
    book.apply([_delta("a#0/0", [3])], 0, 1.0)
    newer = msgspec.structs.replace(_ticket("a", 2), attempt=1)
    keyed = book.open("d1", newer, [1], now=2.0)
    assert [k for k, _ in keyed] == ["a#1/0", "a#1/1"] and book.seqs == 2
    assert [(g.delivery, g.ticket.attempt) for g in book.superseded] == [("d0", 0)]
    assert book.cancelled == ["a#0/0", "a#0/1"]  # ended in the engine by the loop
    assert book.apply([_delta("a#0/0", [4], finished=True), _delta("a#0/1", [5], True)], 0,
                      3.0) == []
    (done,) = book.apply([_delta("a#1/0", [6], True), _delta("a#1/1", [7], True)], 0, 4.0)
    assert done.delivery == "d1" and [s.tokens for s in done.seqs] == [[6], [7]]


@given(in_flight=st.integers(0, 64), partial=st.booleans(), newer_ready=st.booleans(),
       must_sync=st.booleans(), validations=st.booleans())
def test_the_engine_is_emptied_only_when_it_must_be(in_flight: int, partial: bool,
                                                    newer_ready: bool, must_sync: bool,
                                                    validations: bool) -> None:
    action = sync_action(in_flight, partial=partial, newer_ready=newer_ready,
                         must_sync=must_sync, validations=validations)
    wants_empty = newer_ready or must_sync or validations
    # Generation goes on exactly when nothing needs an empty engine.
    assert (action is Action.GO) == (not wants_empty)
    # Weights load and validations run only on an empty engine.
    assert (action is Action.SYNC) == (wants_empty and in_flight == 0)
    # Running responses are aborted only with partial rollout (they resume), else drained.
    if wants_empty and in_flight > 0:
        assert action is (Action.ABORT if partial else Action.DRAIN)
