"""The ticket ledger and the staleness budget: pure folds, tested without Redis.

Properties: folding is the same whether events are applied in one go or from any split
point (a resume folds from a stored position); and verl's staleness semantics hold for a
grid of (staleness_threshold, trigger_parameter_sync_step, replicas, mini-batch): the share
of a sync window's prompts generated with older weights never exceeds the threshold, and a
threshold of 0 trains on-policy only.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runschema.messages import Array, Sample, StepFinished, TicketsClosed, TicketsIssued
from trainer.budget import max_staleness, stale_share_bound, ticket_budget
from trainer.ledger import Ledger, OpenTicket, apply, fold, ticket_id
from trainer.state import TrainerState
from trainer.state import apply as state_apply
from trainer.state import fold as state_fold
from trainer.validate import check_sample, values_in_range


def _issued(first: int, count: int, version: int, attempt: int = 0) -> TicketsIssued:
    return TicketsIssued(ticket_ids=[ticket_id(i) for i in range(first, first + count)], n=2,
                         param_version=version, attempt=attempt)


def _finished(step: int, tickets: list[int], version: int) -> StepFinished:
    ids = [f"{ticket_id(t)}/{i}" for t in tickets for i in range(2)]
    return StepFinished(step=step, sample_ids=ids, metrics={}, duration_s=0.1,
                        param_version=version)


@st.composite
def _runs(draw: st.DrawFn) -> list:
    """A plausible event log: issues, reissues, steps, closures, duplicates."""
    events: list = []
    issued = 0
    open_: list[int] = []
    step = 0
    version = 0
    for _ in range(draw(st.integers(0, 40))):
        kind = draw(st.sampled_from(["issue", "reissue", "step", "close", "dup"]))
        if kind == "issue":
            count = draw(st.integers(1, 6))
            events.append(_issued(issued, count, version))
            open_ += range(issued, issued + count)
            issued += count
        elif kind == "reissue" and open_:
            t = draw(st.sampled_from(open_))
            events.append(_issued(t, 1, version, attempt=draw(st.integers(1, 3))))
        elif kind == "step" and open_:
            take = open_[: draw(st.integers(1, len(open_)))]
            open_ = open_[len(take):]
            step += 1
            version += draw(st.integers(0, 1))
            events.append(_finished(step, take, version))
        elif kind == "close" and open_:
            t = open_.pop(0)
            events.append(TicketsClosed(ticket_ids=[ticket_id(t)], reason="dead-lettered"))
        elif kind == "dup" and events:
            events.append(draw(st.sampled_from(events)))
    return events


@settings(max_examples=200, deadline=None)
@given(_runs(), st.data())
def test_fold_equals_folding_from_any_split_point(events: list, data: st.DataObject) -> None:
    whole = fold(events)
    split = data.draw(st.integers(0, len(events)))
    assert fold(events[split:], fold(events[:split])) == whole
    one_by_one = Ledger()
    for e in events:
        one_by_one = apply(one_by_one, e)
    assert one_by_one == whole
    state = state_fold(events)
    assert state_fold(events[split:], state_fold(events[:split])) == state
    assert state.ledger == whole


@settings(max_examples=200, deadline=None)
@given(_runs())
def test_open_tickets_are_issued_minus_trained_minus_closed(events: list) -> None:
    ledger = fold(events)
    trained = {int(sid.split("/")[0][1:]) for e in events if isinstance(e, StepFinished)
               for sid in e.sample_ids}
    closed = {int(t[1:]) for e in events if isinstance(e, TicketsClosed) for t in e.ticket_ids}
    assert set(ledger.open) == set(range(ledger.issued)) - trained - closed
    assert ledger.window >= 0


def test_window_restarts_at_a_sync_from_what_is_still_open() -> None:
    ledger = fold([_issued(0, 6, 0)])
    assert (ledger.window, ledger.room(6)) == (6, 0)
    ledger = apply(ledger, _finished(1, [0, 1], version=0))  # no sync: the count stays
    assert (ledger.window, ledger.outstanding, ledger.room(6)) == (6, 4, 0)
    ledger = apply(ledger, _finished(2, [2, 3], version=1))  # a sync: 2 still open
    assert (ledger.window, ledger.room(6)) == (2, 4)
    ledger = apply(ledger, _issued(6, 4, 1))
    assert ledger.room(6) == 0
    # A reissue is the same prompt again: not counted twice.
    assert apply(ledger, _issued(4, 1, 1, attempt=1)).window == ledger.window
    # A ticket given up produced nothing: its slot is free within the window.
    assert apply(ledger, TicketsClosed(ticket_ids=["t5"], reason="x")).room(6) == 1


def test_a_step_that_trained_a_given_up_ticket_is_believed_over_the_close() -> None:
    """bench/chaos.py (a busy machine): a TicketsClosed of an open ticket written into the
    trainer's stream by a user the ACL cannot stop, then the trainer's own step training that
    ticket (it never read the close). A reader believed the close and refused the step, so
    a resumed trainer redid it without the ticket, which stayed given up: lost. The step
    names answers; the close names nothing to check: the step wins."""
    from trainer.ledger import GIVEN_UP_KEPT, refusal

    ledger = fold([_issued(0, 4, 0), TicketsClosed(ticket_ids=["t2"], reason="forged")])
    assert set(ledger.open) == {0, 1, 3} and set(ledger.given_up) == {2}
    step = _finished(1, [1, 2], version=1)
    assert refusal(ledger, step) is None
    ledger = apply(ledger, step)
    assert set(ledger.open) == {0, 3} and ledger.given_up == {}
    # Trained once: a copy of the step now names tickets no longer open or given up.
    assert refusal(ledger, _finished(2, [2], version=1)) is not None
    # Bounded, whatever the closes.
    many = fold([_issued(0, GIVEN_UP_KEPT + 10, 0),
                 *(TicketsClosed(ticket_ids=[ticket_id(i)], reason="x")
                   for i in range(GIVEN_UP_KEPT + 10))])
    assert len(many.given_up) == GIVEN_UP_KEPT and 0 not in many.given_up


def test_state_keeps_only_what_a_resume_needs() -> None:
    from runschema.messages import BlobRef, CheckpointSaved, WeightsPublished

    state = TrainerState()
    for step in range(1, 51):
        state = state_apply(state, _issued(step * 10, 2, step - 1))
        if step % 10 == 0:
            state = state_apply(state, CheckpointSaved(
                step=step, path=f"ckpt/step-{step:06d}.pt", param_version=step))
        state = state_apply(state, WeightsPublished(
            version=step, ref=BlobRef(store="redis", key=f"w{step}", size=1, sha256="0")))
        state = state_apply(state, _finished(step, [step * 10, step * 10 + 1], step))
    assert state.checkpoint() == (50, "ckpt/step-000050.pt")
    assert state.steps_after_checkpoint() == ()
    # One earlier checkpoint and the steps after it: the fallback if the newest is missing.
    assert state.checkpoints() == [(50, "ckpt/step-000050.pt"), (40, "ckpt/step-000040.pt")]
    assert [r.step for r in state.steps] == list(range(41, 51))
    assert len(state.weights) <= 8 and state.ledger.outstanding == 0


# --------------------------------------------------------------------------- validation


def _sample(**kw) -> Sample:
    base = dict(sample_id="t3/1", ticket_id="t3", prompt_id="p", index=1, n=2,
                prompt_tokens=Array.of(np.asarray([1, 2], dtype=np.int32)),
                response_tokens=Array.of(np.asarray([3, 4], dtype=np.int32)),
                logprobs=Array.of(np.asarray([-0.1, -0.2], dtype=np.float32)),
                reward=1.0, min_version=2, max_version=2)
    return Sample(**{**base, **kw})


TICKET = OpenTicket(index=3, n=2, attempt=0, version=2)


@pytest.mark.parametrize(("change", "reason"), [
    ({}, None),
    ({"n": 8}, "asked for n=2"),
    ({"index": 5, "sample_id": "t3/5"}, "outside 0..1"),
    ({"sample_id": "t4/1"}, "does not match"),
    ({"logprobs": Array.of(np.asarray([-0.1], dtype=np.float32))}, "1 log-probs for 2"),
    ({"response_tokens": Array.of(np.asarray([3, 4, 5, 6, 7, 8], dtype=np.int32)),
      "logprobs": Array.of(np.zeros(6, dtype=np.float32))}, "more than rollout.max_new_tokens"),
    ({"response_tokens": Array.of(np.asarray([3.0, 4.0], dtype=np.float32))}, "integers"),
    ({"reward": float("nan")}, "not finite"),
    ({"logprobs": Array.of(np.asarray([0.5, -0.2], dtype=np.float32))}, "<= 0"),
    ({"logprobs": Array.of(np.asarray([-0.1, np.nan], dtype=np.float32))}, "finite"),
    ({"logprobs": Array.of(np.asarray([-np.inf, -0.2], dtype=np.float32))}, "finite"),
    ({"logprobs": Array.of(np.asarray([-0.1, np.inf], dtype=np.float32))}, "finite"),
    ({"logprobs": Array.of(np.asarray([-0.1, -0.0], dtype=np.float64))}, None),
    ({"min_version": 1, "max_version": 1}, "outside 2..3"),
    ({"max_version": 9}, "outside 2..3"),
    ({"attempt": 1}, "never issued"),
    ({"prompt_tokens": Array.of(np.asarray([1, 999], dtype=np.int32))}, "vocabulary"),
])
def test_check_sample(change: dict, reason: str | None) -> None:
    got = check_sample(_sample(**change), TICKET, version=3, max_new_tokens=5, vocab_size=100)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got, got


# One sample's arrays: (prompt, response, log-probs), each as it may arrive in a stream.
_ARRAYS = {
    "ok": (Array.of(np.asarray([1, 2], np.int32)), Array.of(np.asarray([3, 4], np.int32)),
           Array.of(np.asarray([-0.1, -0.2], np.float32))),
    "token out of vocabulary": (Array.of(np.asarray([1, 100], np.int32)),
                                Array.of(np.asarray([3, 4], np.int32)),
                                Array.of(np.asarray([-0.1, -0.2], np.float32))),
    "negative token": (Array.of(np.asarray([1, 2], np.int32)),
                       Array.of(np.asarray([-3, 4], np.int32)),
                       Array.of(np.asarray([-0.1, -0.2], np.float32))),
    "nan log-prob": (Array.of(np.asarray([1, 2], np.int32)), Array.of(np.asarray([3, 4], np.int32)),
                     Array.of(np.asarray([np.nan, -0.2], np.float32))),
    "positive log-prob": (Array.of(np.asarray([1, 2], np.int32)),
                          Array.of(np.asarray([3, 4], np.int32)),
                          Array.of(np.asarray([-0.1, 0.5], np.float32))),
    "int64 tokens": (Array.of(np.asarray([1, 2], np.int64)), Array.of(np.asarray([3, 4], np.int64)),
                     Array.of(np.asarray([-0.1, -0.2], np.float32))),
    "float64 log-probs": (Array.of(np.asarray([1, 2], np.int32)),
                          Array.of(np.asarray([3, 4], np.int32)),
                          Array.of(np.asarray([-0.1, -0.2], np.float64))),
    # 7 bytes of int32: concatenated, it would shift every later sample's token ids.
    "ragged buffer": (Array(dtype="<i4", data=bytes([1, 0, 0, 0, 2, 0, 0])),
                      Array.of(np.asarray([3, 4], np.int32)),
                      Array.of(np.asarray([-0.1, -0.2], np.float32))),
    "unknown dtype": (Array(dtype="zzz", data=bytes(8)), Array.of(np.asarray([3, 4], np.int32)),
                      Array.of(np.asarray([-0.1, -0.2], np.float32))),
    "float tokens": (Array.of(np.asarray([1, 2], np.float32)),
                     Array.of(np.asarray([3, 4], np.int32)),
                     Array.of(np.asarray([-0.1, -0.2], np.float32))),
}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(sorted(_ARRAYS)), min_size=1, max_size=12))
def test_batch_value_check_changes_no_verdict(kinds: list[str]) -> None:
    """The trainer checks a read's values together (values_in_range) and each sample's own
    only when that fails: every sample gets the verdict, and the reason, it gets alone."""
    batch = [_sample(prompt_tokens=p, response_tokens=r, logprobs=lp)
             for p, r, lp in (_ARRAYS[k] for k in kinds)]
    checked = values_in_range(batch, vocab_size=100)
    # Shown together only when all values are in range and each kind has one dtype.
    assert checked == (len(set(kinds)) == 1
                       and kinds[0] in ("ok", "int64 tokens", "float64 log-probs"))
    for s in batch:
        alone = check_sample(s, TICKET, version=3, max_new_tokens=5, vocab_size=100)
        assert check_sample(s, TICKET, version=3, max_new_tokens=5, vocab_size=100,
                            values_checked=checked) == alone


def test_batch_value_check_needs_one_dtype_per_kind() -> None:
    ok, wide = _sample(), _sample(**dict(zip(("prompt_tokens", "response_tokens", "logprobs"),
                                             _ARRAYS["int64 tokens"], strict=True)))
    assert values_in_range([ok, ok], vocab_size=100)
    assert values_in_range([wide, wide], vocab_size=100)
    assert not values_in_range([ok, wide], vocab_size=100)  # then each sample on its own
    assert values_in_range([], vocab_size=100)
    assert values_in_range([ok], vocab_size=None)


# --------------------------------------------------------------------------- staleness grid


def _simulate(s: float, t: int, replicas: int, m: int, seed: int, steps: int = 24
              ) -> tuple[list[float], int]:
    """Trainer and rollouters driven by the real ledger and budget, in random order.

    Rollouters take tickets in issue order and generate with the newest weights; answers
    arrive in random order; the trainer trains the first arrivals. Returns each sync
    window's share of stale prompts and the largest lag trained.
    """
    rng = random.Random(seed)
    per_step = m  # require_batches * ppo_mini_batch_size, with require_batches = 1
    budget = ticket_budget(s, t, 1, m)
    bound = max_staleness(s, t, 1, m)
    ledger, version, queue, busy, arrived = Ledger(), 0, [], [], []
    step = 0
    shares: list[float] = []
    trained = stale = lag_max = 0

    def issue() -> None:
        nonlocal ledger
        room = ledger.room(budget)
        if room:
            event = _issued(ledger.issued, room, version)
            ledger = apply(ledger, event)
            queue.extend((i, version) for i in range(event_first(event), ledger.issued))

    def event_first(event: TicketsIssued) -> int:
        return int(event.ticket_ids[0][1:])

    issue()
    while step < steps:
        actions = []
        if queue and len(busy) < replicas:
            actions.append("claim")
        if busy:
            actions.append("finish")
        if len(arrived) >= per_step:
            actions.append("train")
        match rng.choice(actions):
            case "claim":
                index, _ = queue.pop(0)
                busy.append((index, version))  # generated with the newest weights
            case "finish":
                arrived.append(busy.pop(rng.randrange(len(busy))))
            case "train":
                batch, keep = [], []
                for index, gen in arrived:
                    if len(batch) < per_step and version - gen <= bound:
                        batch.append((index, gen))
                    elif version - gen > bound:
                        ledger = apply(ledger, _issued(index, 1, version, attempt=1))
                        queue.append((index, version))
                    else:
                        keep.append((index, gen))
                if len(batch) < per_step:
                    arrived = batch + keep
                    continue
                arrived = keep
                step += 1
                trained += len(batch)
                stale += sum(1 for _, gen in batch if gen < version)
                lag_max = max([lag_max, *(version - gen for _, gen in batch)])
                if step % t == 0:
                    version += 1
                    shares.append(stale / trained)
                    trained = stale = 0
                ledger = apply(ledger, _finished(step, [i for i, _ in batch], version))
                issue()
    return shares, lag_max


@pytest.mark.parametrize("s", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("m", [2, 8])
def test_stale_share_of_a_sync_window_never_exceeds_verls_bound(
    s: float, t: int, replicas: int, m: int
) -> None:
    bound = stale_share_bound(s, t, 1, m)
    assert bound <= s + 1e-9
    for seed in range(5):
        shares, lag = _simulate(s, t, replicas, m, seed)
        assert max(shares) <= bound + 1e-9, (shares, bound)
        if s == 0:
            assert max(shares) == 0 and lag == 0
