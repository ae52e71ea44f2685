"""The trainer's intake: verdicts on samples, decided without Redis (trainer.intake).

Examples pin each verdict; a property checks that, whatever order and however many copies
of a set of answers arrive in, each open ticket is completed at most once, its winning group
holds exactly one copy of each of its n responses, and every other delivery is accounted for:
a duplicate, waiting in a partial group, or in a partial group of another attempt of a ticket
that completed (dropped: read again later, as a duplicate).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bus import Delivery
from runschema.messages import Array, PromptTicket, Sample
from trainer.intake import Complete, Duplicate, Intake, Refuse, Stale
from trainer.ledger import Ledger, OpenTicket, ticket_id

N = 2


def _sample(ticket: int, index: int, *, attempt: int = 0, version: int = 1,
            reward: float = 1.0) -> Sample:
    return Sample(
        sample_id=f"{ticket_id(ticket)}/{index}", ticket_id=ticket_id(ticket), prompt_id="p",
        index=index, n=N, prompt_tokens=Array.of(np.asarray([1, 2], dtype=np.int32)),
        response_tokens=Array.of(np.asarray([3, 4], dtype=np.int32)),
        logprobs=Array.of(np.asarray([-0.1, -0.2], dtype=np.float32)), reward=reward,
        min_version=version, max_version=version, attempt=attempt)


def _ledger(open_: dict[int, tuple[int, int]], issued: int = 10) -> Ledger:
    """Tickets ``index -> (attempt, version)`` open, ``issued`` issued in all."""
    return Ledger(issued=issued, open={i: OpenTicket(i, N, a, v) for i, (a, v) in open_.items()})


def _deliver(*msgs: object) -> list[Delivery]:
    return [Delivery(f"1-{k}", m, 1, "samples") for k, m in enumerate(msgs)]  # type: ignore[arg-type]


def _judge(intake: Intake, ledger: Ledger, *msgs: object, version: int = 1) -> list:
    return intake.judge(_deliver(*msgs), ledger, version, vocab_size=16, max_len=32)


def test_a_complete_group_is_ready_and_its_ticket_taken() -> None:
    intake = Intake(max_new_tokens=5, max_staleness=1)
    ledger = _ledger({3: (0, 1)})
    assert _judge(intake, ledger, _sample(3, 0)) == []  # one of two: waiting
    (verdict,) = _judge(intake, ledger, _sample(3, 1))
    assert isinstance(verdict, Complete) and verdict.group.index == 3
    assert intake.ready == [verdict.group] and intake.taken == {3}
    assert [s.index for _, s in verdict.group.ordered()] == [0, 1]


def test_garbage_and_unissued_tickets_are_refused() -> None:
    intake = Intake(max_new_tokens=5, max_staleness=1)
    ticket = PromptTicket(ticket_id="t1", prompt_id="p", prompt="12>", answer="21", n=N,
                          min_version=0)
    v1, v2 = _judge(intake, _ledger({}, issued=5), ticket, _sample(7, 0))
    assert isinstance(v1, Refuse) and "expected a Sample" in v1.reason and v1.reissue is None
    assert isinstance(v2, Refuse) and "never issued" in v2.reason and v2.reissue is None
    assert intake.refused == 2


def test_an_invalid_answer_is_refused_with_its_partial_group_and_its_ticket_reissued() -> None:
    intake = Intake(max_new_tokens=5, max_staleness=1)
    ledger = _ledger({3: (0, 1)})
    _judge(intake, ledger, _sample(3, 0))
    verdict, member = _judge(intake, ledger, _sample(3, 1, reward=float("nan")))
    assert isinstance(verdict, Refuse) and verdict.reissue == 3 and "not finite" in verdict.reason
    # The member gathered before is refused with its group, naming the invalid one.
    assert isinstance(member, Refuse) and member.reissue is None
    assert (member.delivery.id, member.delivery.msg.sample_id) == ("1-0", "t3/0")
    assert member.reason.startswith("group of t3 attempt 0 refused whole: member t3/1: reward")
    assert intake.groups == {} and 3 not in intake.taken


def test_copies_of_trained_closed_or_won_tickets_are_duplicates() -> None:
    intake = Intake(max_new_tokens=5, max_staleness=1)
    ledger = _ledger({3: (0, 1)})
    _judge(intake, ledger, _sample(3, 0), _sample(3, 1))
    # The winner's ticket is taken; a second copy of it, of a closed ticket, or the same
    # response twice in a partial group are acked and dropped.
    verdicts = _judge(intake, _ledger({3: (0, 1), 4: (0, 1)}), _sample(3, 0), _sample(2, 0),
                      _sample(4, 0), _sample(4, 0))
    assert [type(v) for v in verdicts] == [Duplicate, Duplicate, Duplicate]
    assert [v.entry_ids for v in verdicts] == [["1-0"], ["1-1"], ["1-3"]]


def test_the_first_complete_attempt_wins_and_the_others_partials_go() -> None:
    intake = Intake(max_new_tokens=5, max_staleness=1)
    ledger = _ledger({3: (1, 1)})  # reissued: attempts 0 and 1 may both answer
    _judge(intake, ledger, _sample(3, 0, attempt=0))
    (won,) = _judge(intake, ledger, _sample(3, 0, attempt=1), _sample(3, 1, attempt=1))
    assert isinstance(won, Complete) and won.group.attempt == 1
    assert intake.groups == {}
    (late,) = _judge(intake, ledger, _sample(3, 1, attempt=0))
    assert isinstance(late, Duplicate)


def test_a_group_older_than_the_staleness_bound_is_stale_not_ready() -> None:
    intake = Intake(max_new_tokens=5, max_staleness=1)
    ledger = _ledger({3: (0, 0)})
    verdicts = _judge(intake, ledger, _sample(3, 0, version=0), _sample(3, 1, version=0),
                      version=2)
    (stale,) = verdicts
    assert isinstance(stale, Stale) and "2 versions old (max 1)" in stale.message
    assert intake.ready == [] and 3 not in intake.taken and intake.discarded == 1
    assert sorted(stale.group.entry_ids()) == ["1-0", "1-1"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, N - 1), st.integers(0, 1)),
                max_size=40),
       st.integers(1, 4))
def test_each_ticket_completes_once_with_one_copy_of_each_response(
    arrivals: list[tuple[int, int, int]], reads: int
) -> None:
    """Any arrival order of answers (ticket, response index, attempt), with copies, split
    into any number of reads."""
    intake = Intake(max_new_tokens=5, max_staleness=1)
    ledger = _ledger({t: (1, 1) for t in range(4)})
    msgs = [_sample(t, i, attempt=a) for t, i, a in arrivals]
    size = max(1, len(msgs) // reads)
    verdicts = []
    for k in range(0, len(msgs), size):
        verdicts += intake.judge(
            [Delivery(f"1-{j}", m, 1, "samples") for j, m in enumerate(msgs[k:k + size], k)],
            ledger, 1, vocab_size=16, max_len=32)
    completed = [v.group for v in verdicts if isinstance(v, Complete)]
    assert len({g.index for g in completed}) == len(completed), "a ticket completed twice"
    for g in completed:
        assert sorted(s.index for _, s in g.ordered()) == list(range(N))
        assert {s.attempt for _, s in g.ordered()} == {g.attempt}
    ids = {f"1-{j}": m for j, m in enumerate(msgs)}
    referenced = {eid for g in completed for eid in g.entry_ids()}
    referenced |= {eid for g in intake.groups.values() for eid in g.entry_ids()}
    referenced |= {eid for v in verdicts if isinstance(v, Duplicate) for eid in v.entry_ids}
    winner = {g.index: g.attempt for g in completed}
    for eid in ids.keys() - referenced:  # dropped with a losing attempt's partial group
        index = int(ids[eid].ticket_id[1:])
        assert winner.get(index, ids[eid].attempt) != ids[eid].attempt, eid
    assert intake.taken == {g.index for g in completed}
