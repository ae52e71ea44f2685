"""The trainer's step core, fed scripted reads: the writes it asks for (trainer.core).

No Redis, no processes, no clock: each test builds a :class:`~trainer.core.StepCore`, hands
it reads made in memory (real messages in :class:`bus.Delivery` values, heartbeats, dead
letters, validation answers) at the times the script says, and checks the actions it
returns. A small in-memory shell carries them out as trainer.app does (tickets get entry
ids, the ledger is folded from what is written, mini-batches go to a recorded worker) and
checks at every turn that the core decided on the ledger the writer would hold.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pytest

from bus import Delivery, Refusal, RunKeys
from policy.tokenizer import CharTokenizer
from runconfig import Config, load_config
from runschema.messages import (
    Array,
    Heartbeat,
    PromptTicket,
    Sample,
    StepFinished,
    StepStarted,
    TicketsClaimed,
    TicketsClosed,
    TicketsIssued,
    ValidationFinished,
    ValidationRequested,
    prompt_digest,
)
from tasks import build_prompt_source
from trainer.actions import (
    Ack,
    Action,
    DeadLetter,
    FinishStep,
    Holders,
    IssueTickets,
    Measured,
    ProfileStep,
    Publish,
    Reads,
    RequestValidation,
    Train,
    Warn,
)
from trainer.core import MAX_READ_SIZE, READ_SIZE, StepCore, next_read_size
from trainer.health import PeerDead
from trainer.ledger import Ledger, ticket_id
from trainer.ledger import apply as ledger_apply
from trainer.ledger import fold as ledger_fold
from trainer.rewardfail import RewardFailed
from trainer.stepwork import StepWork

N = 2  # responses per ticket
KEYS = RunKeys("core")
MEASURED = Measured(wait_s=0.0, update_s=1.0, loop_cpu_s=0.1, ranks=1)


def _cfg(*overrides: str) -> Config:
    """One mini-batch of 2 prompts a step, on-policy (a budget of 2 tickets), one sync a
    step; leases of 30 s (the heartbeat timeout), a progress bound of 30 s."""
    return load_config(overrides=[
        f"rollout.n={N}", "trainer.ppo_mini_batch_size=2", "async_training.require_batches=1",
        "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
        "trainer.total_training_steps=5", "trainer.save_freq=0", *overrides])


def _sample(ticket: int, index: int, *, attempt: int = 0, version: int = 0,
            reward: float = 1.0, error: str = "", timed_out: bool = False) -> Sample:
    return Sample(
        sample_id=f"{ticket_id(ticket)}/{index}", ticket_id=ticket_id(ticket), prompt_id="p",
        index=index, n=N, prompt_tokens=Array.of(np.asarray([1, 2], dtype=np.int32)),
        response_tokens=Array.of(np.asarray([3, 4], dtype=np.int32)),
        logprobs=Array.of(np.asarray([-0.1, -0.2], dtype=np.float32)), reward=reward,
        min_version=version, max_version=version, attempt=attempt, reward_error=error,
        reward_timed_out=timed_out)


def _hb(rank: int, progress: int | None = None) -> Heartbeat:
    return Heartbeat(role="rollouter", rank=rank, pid=100 + rank, progress=progress)


def _kinds(actions: Sequence[Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def _trains(actions: Sequence[Action]) -> list[Train]:
    return [a for a in actions if isinstance(a, Train)]


class Shell:
    """trainer.app's shell in memory: tickets get entry ids ``p-K``, samples ``s-K``; the
    writer's ledger is folded from what is written; mini-batches go to a list."""

    def __init__(self, core: StepCore) -> None:
        self.core = core
        self.ledger = core.ledger
        self.prompt_ids = itertools.count()
        self.sample_ids = itertools.count()
        self.entry_of: dict[str, str] = {}  # ticket id (latest attempt) -> its entry
        self.trained: list[str] = []  # sample ids handed to the worker, in order
        self.written: list[Action] = []
        self.claims = True  # each answer's rollouter claimed its ticket (trainer.claims)

    def deliver(self, *msgs: Any) -> list[Delivery]:
        return [Delivery(f"s-{next(self.sample_ids)}", m, 1, KEYS.samples) for m in msgs]

    def act(self, actions: Sequence[Action], now: float) -> list[Action]:
        for action in actions:
            match action:
                case IssueTickets(tickets, event):
                    self.ledger = ledger_apply(self.ledger, event)
                    ids = [f"p-{next(self.prompt_ids)}" for _ in tickets]
                    self.entry_of.update(zip((t.ticket_id for t in tickets), ids, strict=True))
                    self.core.tickets_written(action, ids, now)
                case Publish(events):
                    for e in events:
                        self.ledger = ledger_apply(self.ledger, e)
                case FinishStep(finished):
                    self.ledger = ledger_apply(self.ledger, finished)
                case Train(groups):
                    self.trained += [s.sample_id for g in groups for s in g]
        assert self.ledger == self.core.ledger, "the core decides on the writer's ledger"
        self.written += actions
        return list(actions)

    def take(self, reads: Reads) -> list[Action]:
        """One turn; the rollouters' claims of the answers delivered come with it, as the
        log has them (each replica claims what it answers), unless ``reads`` names its own
        or :attr:`claims` is off."""
        if self.claims and reads.deliveries and not reads.claims:
            reads = reads._replace(claims=[
                TicketsClaimed(ticket_ids=[d.msg.ticket_id], attempts=[d.msg.attempt],
                               rank=d.msg.rank)
                for d in reads.deliveries if isinstance(d.msg, Sample)])
        return self.act(self.core.take(reads), reads.now)

    def start(self, now: float = 0.0) -> list[Action]:
        return self.act(self.core.issue(), now)

    def finish(self, now: float) -> list[Action]:
        """The step's update done (the worker's futures all resolved): close and finish."""
        closing = self.core.close_step(profiled=False)
        actions = list(closing.early or [])
        return self.act(actions + self.core.finish_step({"actor/loss": 0.5}, MEASURED, now),
                        now)


def _core(cfg: Config, *, ledger: Ledger | None = None, version: int = 0) -> StepCore:
    return StepCore(cfg, build_prompt_source(cfg), KEYS, ledger=ledger or Ledger(),
                    version=version, vocab_size=16, max_len=32, now=0.0)


def _answer(shell: Shell, ticket: int, now: float, **kw: Any) -> list[Action]:
    """All N responses of ``ticket`` in one read."""
    return shell.take(Reads(now, deliveries=shell.deliver(
        *(_sample(ticket, i, **kw) for i in range(N)))))


# ---------------------------------------------------------------------------- a step


def test_a_step_issues_trains_and_finishes_in_order() -> None:
    shell = Shell(_core(_cfg()))
    (issued,) = shell.start()
    assert isinstance(issued, IssueTickets)
    assert [t.ticket_id for t in issued.tickets] == ["t0", "t1"]
    assert issued.event == TicketsIssued(ticket_ids=["t0", "t1"], n=N, param_version=0,
                                         ts=issued.event.ts)
    started = shell.act(shell.core.start_step(1, 1.0), 1.0)
    assert started[0] == ProfileStep(1, begin=True)
    assert isinstance(started[1], Publish) and started[1].events == [
        StepStarted(step=1, param_version=0, ts=started[1].events[0].ts)]
    assert _answer(shell, 0, 2.0) == []  # one group of a mini-batch of two: waiting
    (train,) = _answer(shell, 1, 3.0)
    assert isinstance(train, Train) and train.optimize and shell.core.gathered
    assert shell.trained == ["t0/0", "t0/1", "t1/0", "t1/1"]
    closing = shell.core.close_step(profiled=False)
    assert closing.sync and not closing.save and closing.early == []
    assert shell.core.version == 1
    finished, end, tickets = shell.act(
        shell.core.finish_step({"actor/loss": 0.5}, MEASURED, 5.0), 5.0)
    assert isinstance(finished, FinishStep)
    step = finished.finished
    assert (step.step, step.param_version, step.duration_s) == (1, 1, 4.0)
    assert step.sample_ids == ["t0/0", "t0/1", "t1/0", "t1/1"]
    assert step.entry_ids == ["s-0", "s-1", "s-2", "s-3"]
    assert step.metrics["actor/loss"] == 0.5 and step.metrics["trainer/update_s"] == 1.0
    assert step.metrics["tickets/outstanding"] == 2.0  # as the step ends, before its own fold
    assert end == ProfileStep(1, begin=False)
    assert isinstance(tickets, IssueTickets)
    assert tickets.event.ticket_ids == ["t2", "t3"] and tickets.event.param_version == 1


def test_with_rejection_sampling_a_step_trains_only_once_whole() -> None:
    """verl's rollout_rs needs every mini-batch's log-probs on the step's starting weights:
    no mini-batch optimizes before the step's last one is in."""
    shell = Shell(_core(_cfg("trainer.rollout_rs=seq_mean_k1",
                             "trainer.rollout_rs_threshold=0.99_1.001")))
    shell.start()
    shell.act(shell.core.start_step(1, 1.0), 1.0)
    assert _answer(shell, 0, 2.0) == []
    (train,) = _answer(shell, 1, 3.0)
    assert isinstance(train, Train) and not train.optimize and shell.core.gathered


def test_the_same_script_gives_the_same_writes() -> None:
    def script() -> list[Action]:
        shell = Shell(_core(_cfg()))
        shell.start()
        shell.act(shell.core.start_step(1, 1.0), 1.0)
        shell.take(Reads(2.0, deliveries=shell.deliver(
            _sample(0, 0), _sample(0, 0), _sample(9, 0), _sample(0, 1, reward=float("nan")))))
        _answer(shell, 1, 3.0)
        shell.take(Reads(4.0, idle=True, peers=[_hb(0, 1)]))
        _answer(shell, 0, 5.0, attempt=1)
        shell.finish(6.0)
        return shell.written

    def stamped(actions: list[Action]) -> list[str]:
        # Messages carry a wall-clock ``ts`` stamp: everything else must be equal.
        return [re.sub(r"ts=[0-9.e+-]+", "ts=_", repr(a)) for a in actions]

    first, second = script(), script()
    assert _kinds(first) == _kinds(second) and stamped(first) == stamped(second)
    assert "FinishStep" in _kinds(first)


# ---------------------------------------------------------------------------- (a) duplicates


def test_duplicates_are_acked_and_never_trained_twice() -> None:
    shell = Shell(_core(_cfg()))
    shell.start()
    shell.act(shell.core.start_step(1, 1.0), 1.0)
    # A second copy of a response in the same read; then a whole copy of an answered ticket.
    read = shell.deliver(_sample(0, 0), _sample(0, 1), _sample(0, 1))
    assert shell.take(Reads(2.0, deliveries=read)) == [Ack([read[2].id])]
    copy = shell.deliver(_sample(0, 0), _sample(0, 1))
    assert shell.take(Reads(3.0, deliveries=copy)) == [Ack([copy[0].id, copy[1].id])]
    _answer(shell, 1, 4.0)
    finished = next(a for a in shell.finish(5.0) if isinstance(a, FinishStep)).finished
    assert finished.entry_ids == [read[0].id, read[1].id, "s-5", "s-6"]
    # A trained sample delivered again (a redelivery after a restart): acked, not trained.
    again = shell.deliver(_sample(0, 0), _sample(1, 1))
    shell.act(shell.core.start_step(2, 6.0), 6.0)
    assert shell.take(Reads(7.0, deliveries=again)) == [Ack([again[0].id, again[1].id])]
    assert sorted(shell.trained) == ["t0/0", "t0/1", "t1/0", "t1/1"]
    assert not any(isinstance(a, DeadLetter) for a in shell.written)


# ---------------------------------------------------------------------------- (b) stale groups


def test_a_stale_group_is_acked_warned_and_its_ticket_reissued() -> None:
    # staleness_threshold 1: groups at most one version old are trained.
    cfg = _cfg("async_training.staleness_threshold=1")
    ledger = ledger_fold([TicketsIssued(ticket_ids=["t0", "t1"], n=N, param_version=0)])
    shell = Shell(_core(cfg, ledger=ledger, version=2))
    shell.act(shell.core.start_step(3, 1.0), 1.0)
    ack, warn, reissue = _answer(shell, 0, 2.0, version=0)
    assert ack == Ack(["s-0", "s-1"])
    assert isinstance(warn, Warn) and not warn.say
    assert warn.warning.code == "stale_group_discarded" and "2 versions old" in warn.warning.message
    assert isinstance(reissue, IssueTickets)
    assert reissue.event == TicketsIssued(ticket_ids=["t0"], n=N, param_version=2, attempt=1,
                                          reason="answer too stale", ts=reissue.event.ts)
    assert reissue.tickets[0].min_version == 2
    # One version old: trained (a stale mini-batch: no optimizer step before it is whole).
    assert _answer(shell, 1, 3.0, version=1) == []
    (train,) = _answer(shell, 0, 4.0, attempt=1, version=2)
    assert isinstance(train, Train) and shell.trained == ["t1/0", "t1/1", "t0/0", "t0/1"]
    assert shell.core.intake.discarded == 1


# ---------------------------------------------------------------------------- failed rewards

TYPE_ERROR = "TypeError: compute_score() got an unexpected keyword argument 'data_source'"
TIMED_OUT = "reward function timed out after 30 s (rollout.reward_timeout_s)"


def _scored(shell: Shell, ticket: int, now: float, *errors: str, version: int = 0
            ) -> list[Action]:
    """The N responses of ``ticket`` (generated with weights ``version``) in one read,
    response i failed with ``errors[i]`` (empty: scored; :data:`TIMED_OUT`: the timeout)."""
    errors = errors + ("",) * (N - len(errors))
    return shell.take(Reads(now, deliveries=shell.deliver(*(
        _sample(ticket, i, reward=0.0 if e else 1.0, error=e, timed_out=e == TIMED_OUT,
                version=version) for i, e in enumerate(errors)))))


def test_the_first_failed_reward_stops_the_run_by_default() -> None:
    """reward.max_failure_ratio=0 (verl's behaviour): the first failed score that joins a
    step stops the run, naming the function and its error in one line; nothing of the
    step is recorded."""
    shell = Shell(_core(_cfg("custom_reward_function.path=tasks/foo.py")))
    shell.start()
    shell.act(shell.core.start_step(1, 1.0), 1.0)
    _scored(shell, 0, 2.0)
    with pytest.raises(RewardFailed) as failed:
        _scored(shell, 1, 3.0, "", f"{TYPE_ERROR}\n(more lines)")
    text = str(failed.value)
    assert text.startswith(f"reward function tasks/foo.py:compute_score failed: {TYPE_ERROR} ")
    assert "on 1 of step 1's 4 samples" in text and "reward.max_failure_ratio=0" in text
    assert "\n" not in text
    assert not any(isinstance(a, FinishStep) for a in shell.written)


def test_failed_rewards_under_the_ratio_are_counted_and_above_it_stop_the_run() -> None:
    """reward.max_failure_ratio=0.5 over a step's 4 samples: 2 failed (one an error, one a
    timeout) go on and are counted in the step's metrics; a 3rd in the next step stops it
    as soon as it joins (3 of 4 whatever the rest)."""
    shell = Shell(_core(_cfg("reward.max_failure_ratio=0.5")))
    shell.start()
    shell.act(shell.core.start_step(1, 1.0), 1.0)
    _scored(shell, 0, 2.0, TYPE_ERROR)
    (train,) = _scored(shell, 1, 3.0, TIMED_OUT)
    assert isinstance(train, Train) and shell.core.gathered
    metrics = next(a for a in shell.finish(4.0) if isinstance(a, FinishStep)).finished.metrics
    assert metrics["reward/failed_count"] == 1.0 and metrics["reward/timeout_count"] == 1.0
    shell.act(shell.core.start_step(2, 5.0), 5.0)
    assert _scored(shell, 2, 6.0, TIMED_OUT, TIMED_OUT, version=1) == []  # 2 of 4: goes on
    with pytest.raises(RewardFailed, match=r"^reward function \(the built-in scorer of the "
                                           r"data source\) failed: reward function timed out"):
        _scored(shell, 3, 7.0, "", TYPE_ERROR, version=1)


def test_a_step_without_failures_counts_zero() -> None:
    shell = Shell(_core(_cfg()))
    shell.start()
    shell.act(shell.core.start_step(1, 1.0), 1.0)
    _scored(shell, 0, 2.0)
    _scored(shell, 1, 3.0)
    metrics = next(a for a in shell.finish(4.0) if isinstance(a, FinishStep)).finished.metrics
    assert metrics["reward/failed_count"] == 0.0 and metrics["reward/timeout_count"] == 0.0


def test_a_failure_taken_early_for_the_next_step_lets_this_step_finish() -> None:
    """Groups that complete during step 1 start step 2 at its close (trainer.core): a
    failed reward among them stops the run when step 2 starts, after StepFinished(1)."""
    shell = Shell(_core(_cfg("async_training.staleness_threshold=1")))
    shell.start()  # a budget of 4 tickets: 2 for step 1, 2 early for step 2
    shell.act(shell.core.start_step(1, 1.0), 1.0)
    _scored(shell, 0, 2.0)
    _scored(shell, 1, 3.0)
    _scored(shell, 2, 3.5, TYPE_ERROR)
    _scored(shell, 3, 3.6)
    closing = shell.core.close_step(profiled=False)
    assert closing.early  # step 2's first mini-batch, failure and all
    shell.act(shell.core.take(Reads(3.8, peers=[_hb(0)])), 3.8)  # the close's peer read
    finished = shell.act(shell.core.finish_step({}, MEASURED, 4.0), 4.0)
    assert next(a for a in finished if isinstance(a, FinishStep)).finished.step == 1
    with pytest.raises(RewardFailed, match="on 1 of step 2's 4 samples"):
        shell.core.start_step(2, 5.0)


def test_groups_read_while_the_update_ends_train_behind_the_weights() -> None:
    """The shell reads on while a gathered step's update ends (Trainer._finish): the next
    step's groups that complete meanwhile are its first mini-batch at the close (``early``,
    queued behind this step's weights), and its StepFinished counts them."""
    shell = Shell(_core(_cfg("async_training.staleness_threshold=1")))
    shell.start()  # a budget of 4 tickets: 2 for step 1, 2 for step 2
    shell.act(shell.core.start_step(1, 1.0), 1.0)
    _answer(shell, 0, 2.0)
    _answer(shell, 1, 2.5)
    assert shell.core.gathered
    assert _answer(shell, 2, 3.0) == [] and _answer(shell, 3, 3.5) == []  # read, queued
    closing = shell.core.close_step(profiled=False)
    (early,) = _trains(closing.early or [])
    assert [g[0].ticket_id for g in early.groups] == ["t2", "t3"]
    shell.act(list(closing.early or []) + shell.core.finish_step({}, MEASURED, 4.0), 4.0)
    shell.act(shell.core.start_step(2, 4.0), 4.0)
    assert shell.core.gathered  # nothing left to read for step 2
    shell.core.close_step(profiled=False)
    (finished,) = [a for a in shell.core.finish_step({}, MEASURED, 5.0)
                   if isinstance(a, FinishStep)]
    assert finished.finished.metrics["trainer/early_groups"] == 2.0


# ---------------------------------------------------------------------------- (c) dead peers


def _issued_at_zero(cfg: Config) -> Shell:
    shell = Shell(_core(cfg))
    shell.start(0.0)
    shell.act(shell.core.start_step(1, 0.0), 0.0)
    return shell


def _idle(shell: Shell, now: float, peers: list[Heartbeat],
          owner: str | None = "rollouter-0") -> list[Action]:
    """An idle turn, reading what the core says is due: every ticket entry still in the
    prompts stream, pending on ``owner``."""
    due = shell.core.due(now)
    entries = set(shell.entry_of.values())
    holders = (Holders(due.expired, entries, dict.fromkeys(entries, owner) if owner else {})
               if due.expired else None)
    assert due.entries == [shell.entry_of[ticket_id(i)] for i in due.expired]
    return shell.take(Reads(now, peers=peers if due.peers else None, holders=holders,
                            idle=True))


QUIET = "heartbeat.stall_warn_s=1000"  # no stall warnings in these scripts


def test_a_dead_rollouters_tickets_are_reissued_after_their_lease_only() -> None:
    shell = _issued_at_zero(_cfg(QUIET))
    assert _idle(shell, 1.0, [_hb(0), _hb(1)]) == []
    # rollouter0's liveness key lapses; its tickets keep their lease (30 s) until it ends.
    assert shell.core.due(29.0).expired == []
    assert _idle(shell, 29.0, [_hb(1)]) == []
    (reissue,) = _idle(shell, 31.0, [_hb(1)])
    assert isinstance(reissue, IssueTickets)
    assert reissue.event.ticket_ids == ["t0", "t1"] and reissue.event.attempt == 1
    assert reissue.event.reason == "unanswered for 30 s (ticket lease)"
    # Their new attempts have leases of their own: nothing more until they end.
    assert _idle(shell, 40.0, [_hb(1)]) == []


def test_tickets_of_a_live_rollouter_keep_their_lease_however_long() -> None:
    shell = _issued_at_zero(_cfg(QUIET))
    assert _idle(shell, 1.0, [_hb(0, progress=1)]) == []
    for now, progress in ((31.0, 2), (62.0, 3), (93.0, 4)):  # slow, but moving
        assert _idle(shell, now, [_hb(0, progress=progress)]) == []
    # Queued (not yet delivered to anyone) is not lost either.
    assert _idle(shell, 124.0, [_hb(0, progress=5)], owner=None) == []


def test_a_live_rollouter_whose_progress_stops_loses_its_tickets() -> None:
    shell = _issued_at_zero(_cfg(QUIET))
    assert _idle(shell, 1.0, [_hb(0, progress=7)]) == []
    # Expired at 31, but the counter stood still only 30 s (the bound is 30 s): kept.
    assert _idle(shell, 31.0, [_hb(0, progress=7)]) == []
    warn, reissue = _idle(shell, 62.0, [_hb(0, progress=7)])
    assert isinstance(warn, Warn) and warn.warning.code == "rollouter_no_progress"
    assert warn.warning.message.startswith("rollouter0 (pid 100) holds 2 open ticket(s) (t0, t1)"
                                           " and its progress counter stayed at 7 for 61 s")
    assert isinstance(reissue, IssueTickets) and reissue.event.ticket_ids == ["t0", "t1"]
    assert reissue.event.reason == "held by a rollouter without progress for 30 s"


def test_no_rollouter_alive_for_the_heartbeat_timeout_fails_the_run() -> None:
    shell = _issued_at_zero(_cfg("heartbeat.ticket_lease_s=1000"))
    _idle(shell, 1.0, [_hb(0)])
    _idle(shell, 2.0, [])
    with pytest.raises(PeerDead, match="no rollouter is alive"):
        _idle(shell, 31.0, [])


def test_no_rollouter_alive_repeats_what_the_rollouters_stated_when_they_went() -> None:
    """Rollouters that failed on Redis out of memory said so; the trainer's "no rollouter is
    alive" repeats it (its own writes may go through again once theirs stopped). A rank
    seen alive again is no longer blamed."""
    from runschema.messages import ComponentFailed

    oom = "Redis at redis://r is out of memory: used_memory 8.3M of maxmemory 8.2M"
    shell = _issued_at_zero(_cfg("heartbeat.ticket_lease_s=1000"))
    _idle(shell, 1.0, [_hb(0), _hb(1)])
    shell.take(Reads(1.5, peer_failed=[ComponentFailed(role="rollouter", rank=1, error="x"),
                                       ComponentFailed(role="rollouter", rank=0, error=oom)]))
    _idle(shell, 2.0, [_hb(1)])  # rank 1 back: its old failure is history
    _idle(shell, 3.0, [])
    with pytest.raises(PeerDead) as raised:
        _idle(shell, 40.0, [])
    assert str(raised.value).startswith("no rollouter is alive: none has refreshed")
    assert str(raised.value).endswith(f"; rollouter0 failed: {oom}")


def test_rollouts_failing_without_a_sample_fail_the_run() -> None:
    from runschema.messages import RolloutFailed

    shell = _issued_at_zero(_cfg())
    failed = [RolloutFailed(ticket_id="t0", rank=0, error="boom")] * 9
    shell.take(Reads(1.0, failures=failed))
    shell.take(Reads(1.5, deliveries=shell.deliver(_sample(0, 0))))  # a sample: not all failing
    shell.take(Reads(2.0, failures=[*failed, failed[0]]))
    with pytest.raises(PeerDead, match="rollouts keep failing: 10 failures"):
        shell.take(Reads(2.5, idle=True))


def test_a_ticket_the_rollouters_dead_lettered_is_closed_and_replaced() -> None:
    shell = _issued_at_zero(_cfg())
    dead = PromptTicket(ticket_id="t1", prompt_id="p1", prompt="", answer="", n=N,
                        min_version=0)
    closed, warned, issued = shell.take(Reads(1.0, dead_tickets=[dead]))
    assert isinstance(closed, Publish) and isinstance(closed.events[0], TicketsClosed)
    assert closed.events[0].ticket_ids == ["t1"]
    assert isinstance(warned, Publish)
    assert isinstance(issued, IssueTickets) and issued.event.ticket_ids == ["t2"]
    assert shell.take(Reads(2.0, dead_tickets=[dead])) == []  # already closed


# ---------------------------------------------------------------------------- refusals


def test_refused_entries_are_dead_lettered_with_their_reason() -> None:
    shell = _issued_at_zero(_cfg())
    read = shell.deliver(_hb(0), _sample(7, 0), _sample(0, 0, reward=float("nan")),
                         _sample(0, 1, reward=float("inf")))
    out = shell.take(Reads(1.0, deliveries=read))
    # The read's refusals in one dead-letter batch (one round trip), before the reissue; the
    # rest of the bad group is refused with it, naming the member and the check.
    assert _kinds(out) == ["DeadLetter", "IssueTickets"]
    assert out[0] == DeadLetter([
        Refusal(read[0], "expected a Sample, got Heartbeat", "not a sample"),
        Refusal(read[1], "ticket 't7' was never issued", "ticket never issued"),
        Refusal(read[2], "invalid answer of t0: t0/0: reward nan is not finite (reward check)",
                "invalid answer"),
        Refusal(read[3], "group of t0 attempt 0 refused whole: member t0/0: reward nan is not "
                         "finite (reward check)", "invalid answer")])
    # One new attempt for the bad group, whatever else of it is refused.
    assert isinstance(out[1], IssueTickets) and out[1].event.attempt == 1
    assert out[1].event.reason == "an answer was invalid"
    # The dead letter of a refused answer asks for nothing more: that attempt was replaced.
    bad = read[2].msg
    assert isinstance(bad, Sample) and shell.take(Reads(2.0, lost_samples=[bad])) == []
    # The new attempt's answer dead-lettered elsewhere: answered again, once.
    lost = _sample(0, 0, attempt=1)
    (again,) = shell.take(Reads(3.0, lost_samples=[lost, _sample(0, 1, attempt=1)]))
    assert isinstance(again, IssueTickets) and again.event.attempt == 2
    assert again.event.reason == "an answer was dead-lettered"


# ---------------------------------------------------------------------------- samples vs tickets

# What a rollouter answering another's ticket sends: its own rank, another prompt, log-probs
# of 0.0 (issue 36); the core must refuse it on the claim and the prompt, not on the values.


def _claim(ticket: int, rank: int, attempt: int = 0) -> TicketsClaimed:
    return TicketsClaimed(ticket_ids=[ticket_id(ticket)], attempts=[attempt], rank=rank)


def _checked_core(cfg: Config) -> Shell:
    """A core whose tickets carry the digest of their text prompts (the char tokenizer, as
    the rollouters encode them), issued at 0 with step 1 begun; each read states only the
    claims the test gives."""
    core = StepCore(cfg, build_prompt_source(cfg), KEYS, ledger=Ledger(), version=0,
                    vocab_size=CharTokenizer().vocab_size, max_len=32, now=0.0,
                    encode=lambda text: CharTokenizer().encode(text, bos=True))
    shell = Shell(core)
    shell.claims = False
    shell.start(0.0)
    shell.act(shell.core.start_step(1, 0.0), 0.0)
    return shell


def _real(shell: Shell, ticket: int, index: int, *, rank: int = 0, attempt: int = 0,
          reward: float = 1.0, prompt: list[int] | None = None,
          logprobs: list[float] | None = None) -> Sample:
    """Response ``index`` of ``ticket`` with the ticket's real prompt (unless ``prompt``)."""
    text = shell.core.dispatch.prompts.get(ticket).prompt
    ids = CharTokenizer().encode(text, bos=True) if prompt is None else prompt
    return msgspec.structs.replace(
        _sample(ticket, index, attempt=attempt, reward=reward),
        prompt_tokens=Array.of(np.asarray(ids, dtype=np.int32)), rank=rank,
        logprobs=Array.of(np.asarray(logprobs or [-0.1, -0.2], dtype=np.float32)))


def _letters(actions: Sequence[Action]) -> list[tuple[str, str]]:
    """Every refusal of the dead-letter batches in ``actions``: (sample id, reason)."""
    return [(r.entry.msg.sample_id, r.reason)  # type: ignore[union-attr]
            for a in actions if isinstance(a, DeadLetter) for r in a.refusals]


def test_tickets_carry_their_prompts_digest() -> None:
    shell = _checked_core(_cfg())
    (issued,) = [a for a in shell.written if isinstance(a, IssueTickets)]
    for t in issued.tickets:
        ids = CharTokenizer().encode(t.prompt, bos=True)
        assert t.prompt_digest == prompt_digest(ids) != ""
        assert t.prompt_digest == prompt_digest(Array.of(np.asarray(ids, dtype=np.int64)))


def test_another_rollouters_forged_answer_is_refused_alone_and_never_trained() -> None:
    """rollouter 1 answers t0, which rollouter 0 claimed, with another prompt and log-probs
    of 0.0: each forged response is dead-lettered alone naming the holder check (no new
    attempt: the holder's answer is on its way), and the holder's answer trains."""
    shell = _checked_core(_cfg())
    forged = shell.deliver(*(_real(shell, 0, i, rank=1, prompt=[1, 5, 6],
                                   logprobs=[0.0, 0.0]) for i in range(N)))
    out = shell.take(Reads(1.0, deliveries=forged, claims=[_claim(0, 0), _claim(1, 0)]))
    assert _kinds(out) == ["DeadLetter"]  # one batch
    assert _letters(out) == [
        (f"t0/{i}", f"t0/{i} refused alone: rollouter 1 answered attempt 0 of t0, claimed by "
                    "rollouter 0 (holder check)") for i in range(N)]
    # Read back from the dead-letter stream, they ask for no new attempt either.
    assert shell.take(Reads(2.0, lost_samples=[d.msg for d in forged])) == []  # type: ignore[misc]
    real = shell.deliver(*(_real(shell, t, i) for t in (0, 1) for i in range(N)))
    (train,) = shell.take(Reads(3.0, deliveries=real))
    assert isinstance(train, Train)
    finished = next(a for a in shell.finish(4.0) if isinstance(a, FinishStep)).finished
    assert finished.entry_ids == [d.id for d in real]
    assert not {d.id for d in forged} & set(finished.entry_ids)
    assert finished.metrics["samples/refused"] == 2.0


def test_an_answer_nobody_claimed_is_refused_alone() -> None:
    shell = _checked_core(_cfg())
    read = shell.deliver(_real(shell, 0, 0, rank=3))
    assert _letters(shell.take(Reads(1.0, deliveries=read))) == [
        ("t0/0", "t0/0 refused alone: rollouter 3 answered attempt 0 of t0, claimed by no "
                 "rollouter (holder check)")]


def test_the_holders_answer_with_another_prompt_is_refused_with_its_group() -> None:
    shell = _checked_core(_cfg())
    good, bad = shell.deliver(_real(shell, 0, 0), _real(shell, 0, 1, prompt=[1, 5, 6]))
    out = shell.take(Reads(1.0, deliveries=[good, bad], claims=[_claim(0, 0)]))
    assert _kinds(out) == ["DeadLetter", "IssueTickets"]
    assert _letters(out) == [
        ("t0/1", "invalid answer of t0: t0/1: its 3 prompt tokens are not the prompt of t0 "
                 "(prompt digest check)"),
        ("t0/0", "group of t0 attempt 0 refused whole: member t0/1: its 3 prompt tokens are "
                 "not the prompt of t0 (prompt digest check)")]


@pytest.mark.parametrize(("reward", "check"), [
    (1e300, "reward 1e+300 outside reward.bounds [-1e+06, 1e+06] (reward check)"),
    (-1.7e308, "reward -1.7e+308 outside reward.bounds [-1e+06, 1e+06] (reward check)"),
    (float("nan"), "reward nan is not finite (reward check)"),
    (float("inf"), "reward inf is not finite (reward check)"),
])
def test_a_group_with_one_invalid_reward_is_refused_whole(reward: float, check: str) -> None:
    """Two prompts of n=3: t0's middle member has an absurd or non-finite reward, its other
    members come before and after it. Every member of t0 is dead-lettered naming t0/1 and
    the check; t0 is answered again once; t1 trains, and t0's new attempt completes the
    step."""
    shell = _checked_core(_cfg("rollout.n=3"))
    claims = [_claim(0, 0), _claim(1, 0)]
    first = shell.deliver(*(msgspec.structs.replace(s, n=3) for s in (
        _real(shell, 0, 0), _real(shell, 0, 1, reward=reward), _real(shell, 1, 0))))
    out = shell.take(Reads(1.0, deliveries=first, claims=claims))
    rest = shell.deliver(*(msgspec.structs.replace(s, n=3) for s in (
        _real(shell, 0, 2), _real(shell, 1, 1), _real(shell, 1, 2))))
    out += shell.take(Reads(2.0, deliveries=rest))
    assert [a.event.attempt for a in out if isinstance(a, IssueTickets)] == [1]
    assert _letters(out) == [
        ("t0/1", f"invalid answer of t0: t0/1: {check}"),
        ("t0/0", f"group of t0 attempt 0 refused whole: member t0/1: {check}"),
        ("t0/2", f"group of t0 attempt 0 refused whole: member t0/1: {check}")]
    assert shell.trained == []  # t1 waits for a second group to fill the mini-batch
    again = shell.deliver(*(msgspec.structs.replace(_real(shell, 0, i, attempt=1), n=3)
                            for i in range(3)))
    (train,) = shell.take(Reads(3.0, deliveries=again, claims=[_claim(0, 0, attempt=1)]))
    assert isinstance(train, Train)
    assert shell.trained == ["t1/0", "t1/1", "t1/2", "t0/0", "t0/1", "t0/2"]
    finished = next(a for a in shell.finish(4.0) if isinstance(a, FinishStep)).finished
    assert finished.entry_ids == [first[2].id, rest[1].id, rest[2].id, *(d.id for d in again)]
    assert finished.metrics["samples/refused"] == 3.0
    assert all(s.reward == 1.0 for g in train.groups for s in g)


def test_a_reissued_ticket_is_answered_by_its_new_holder() -> None:
    """t0 claimed by rollouter 0, whose liveness lapses; reissued (attempt 1) and claimed by
    rollouter 1: rollouter 1's answer of attempt 1 trains; its answer of attempt 0 (which
    it never claimed) would not."""
    shell = _checked_core(_cfg(QUIET))
    shell.take(Reads(0.5, claims=[_claim(0, 0), _claim(1, 0)]))
    assert _idle(shell, 1.0, [_hb(0), _hb(1)]) == []
    (reissue,) = _idle(shell, 31.0, [_hb(1)])
    assert isinstance(reissue, IssueTickets) and reissue.event.attempt == 1
    stray = shell.deliver(_real(shell, 0, 0, rank=1))
    assert _letters(shell.take(Reads(32.0, deliveries=stray, claims=[
        _claim(0, 1, attempt=1), _claim(1, 1, attempt=1)]))) == [
        ("t0/0", "t0/0 refused alone: rollouter 1 answered attempt 0 of t0, claimed by "
                 "rollouter 0 (holder check)")]
    answers = shell.deliver(*(_real(shell, t, i, rank=1, attempt=1)
                              for t in (0, 1) for i in range(N)))
    (train,) = shell.take(Reads(33.0, deliveries=answers))
    assert isinstance(train, Train)
    assert shell.trained == ["t0/0", "t0/1", "t1/0", "t1/1"]


def test_a_flood_of_junk_is_one_dead_letter_batch_per_read_and_reads_grow() -> None:
    """Thousands of bad entries in one read: one DeadLetter with all of them (one round trip
    for the shell), counted by kind; full reads mostly refused ask for twice as many next
    time, up to MAX_READ_SIZE, and a read of samples again goes back to READ_SIZE."""
    shell = _issued_at_zero(_cfg())
    core = shell.core
    assert core.read_size == READ_SIZE
    junk = [_hb(i % 3) if i % 2 else _sample(10**6 + i, 0) for i in range(READ_SIZE)]
    read = shell.deliver(*junk)
    out = shell.take(Reads(1.0, deliveries=read))
    assert _kinds(out) == ["DeadLetter"]
    (letter,) = out
    assert isinstance(letter, DeadLetter) and [r.entry for r in letter.refusals] == list(read)
    kinds = [r.kind for r in letter.refusals]
    assert kinds.count("not a sample") == kinds.count("ticket never issued") == READ_SIZE // 2
    assert core.read_size == 2 * READ_SIZE
    # A full read of undecodable entries (refused by the consumer, never delivered) grows
    # it too, as an idle turn; up to the cap.
    for _ in range(10):
        shell.take(Reads(2.0, refused=core.read_size, idle=True))
    assert core.read_size == MAX_READ_SIZE
    # Reports alone are not a read: the size stays.
    shell.take(Reads(3.0))
    assert core.read_size == MAX_READ_SIZE
    # The junk drained: a read of real samples goes back to the usual size.
    shell.take(Reads(4.0, deliveries=shell.deliver(_sample(0, 0))))
    assert core.read_size == READ_SIZE


@pytest.mark.parametrize(("size", "read", "refused", "after"), [
    (256, 256, 256, 512), (256, 256, 128, 512), (256, 256, 127, READ_SIZE),
    (512, 300, 300, READ_SIZE), (MAX_READ_SIZE, MAX_READ_SIZE, MAX_READ_SIZE, MAX_READ_SIZE),
    (256, 0, 0, READ_SIZE)])
def test_next_read_size(size: int, read: int, refused: int, after: int) -> None:
    assert next_read_size(size, read, refused) == after


# ---------------------------------------------------------------------------- (d) validation


def test_a_validation_answer_mid_step_changes_none_of_the_steps_writes() -> None:
    cfg = _cfg("data.val_files=[/none/val.parquet]", "trainer.test_freq=1")

    def step(answer_at: int | None) -> Shell:
        shell = Shell(_core(cfg))
        shell.start()
        (request,) = shell.act(shell.core.published(0), 0.0)
        assert isinstance(request, RequestValidation)
        assert request == RequestValidation(ValidationRequested(
            request_id="val-v0", version=0, step=0, ts=request.request.ts))
        shell.act(shell.core.start_step(1, 1.0), 1.0)
        answer = ValidationFinished(request_id="val-v0", version=0, step=0, rank=0,
                                    metrics={"val-core/x/reward/mean@1": 1.0})
        for turn, ticket in enumerate((0, 1)):
            samples = shell.deliver(*(_sample(ticket, i) for i in range(N)))
            shell.take(Reads(2.0 + turn, deliveries=samples,
                             validated=[answer] if turn == answer_at else []))
        shell.finish(4.0)
        return shell

    told, untold = step(answer_at=0), step(answer_at=None)
    assert not told.core.validations.pending
    assert set(untold.core.validations.pending) == {"val-v0"}  # the run's end waits for it
    assert _kinds(told.written) == _kinds(untold.written)
    assert told.trained == untold.trained
    # The next version is validated after its publication (test_freq=1), never waited for.
    (request,) = told.core.published(1)
    assert isinstance(request, RequestValidation) and request.request.version == 1


def _resumed(validated: Sequence[str], *overrides: str) -> StepCore:
    """The core of a trainer resumed after step 17 of 20 (T=2: weights v8, published after
    step 16), validation every 2 versions."""
    cfg = _cfg("data.val_files=[/none/val.parquet]", "trainer.test_freq=2",
               "async_training.trigger_parameter_sync_step=2", "trainer.total_training_steps=20",
               *overrides)
    return StepCore(cfg, build_prompt_source(cfg), KEYS, ledger=Ledger(), version=8,
                    vocab_size=16, max_len=32, now=0.0, validated=validated)


def test_a_resumed_trainer_never_asks_again_for_a_validation_the_log_answered() -> None:
    """The decision that once hung a resumed run at its end: it published v8 again after
    step 17 and asked for val-v8 again, answered before the kill; no rollouter answers a
    request twice, so the run's end waited for ever."""
    answered = [f"val-v{v}" for v in (0, 2, 4, 6, 8)]
    assert _resumed(answered).published(17) == []
    # Asked and not answered before the kill: asked again, named as the uninterrupted run
    # names it (the step that published v8), and awaited.
    (again,) = _resumed(answered[:-1]).published(17)
    assert isinstance(again, RequestValidation)
    assert (again.request.request_id, again.request.version, again.request.step) == (
        "val-v8", 8, 16)
    # An answer read later (a copy asked before the kill) is one of the same request.
    core = _resumed(answered[:-1])
    core.published(17)
    core.take(Reads(1.0, validated=[ValidationFinished(
        request_id="val-v8", version=8, step=16, rank=0, metrics={})]))
    assert not core.validations.pending and core.published(17) == []
    # A run resumed with another trigger: the versions do not count its syncs.
    (other,) = _resumed(answered[:-1], "async_training.trigger_parameter_sync_step=1",
                        "trainer.total_training_steps=40").published(17)
    assert isinstance(other, RequestValidation) and other.request.step == 17


def test_the_wait_for_the_last_validation_is_said_then_fails_past_the_bound() -> None:
    core = _resumed([], "heartbeat.stall_warn_s=10", "heartbeat.stall_timeout_s=30",
                    "heartbeat.timeout_s=100")
    assert core.settled
    core.version = 10  # steps 18..20 closed: the last sync (the shell's work)
    (request,) = core.published(20)
    assert isinstance(request, RequestValidation) and request.request.request_id == "val-v10"
    core.end()
    assert not core.settled
    peers = [_hb(0)]
    assert core.take(Reads(5.0, peers=peers, idle=True)) == []
    (warn,) = core.take(Reads(11.0, peers=peers, idle=True))
    assert isinstance(warn, Warn) and warn.say and warn.warning.code == "trainer_stalled"
    assert "val-v10 (weights v10, asked after step 20)" in warn.warning.message
    assert "rollouter0" in warn.warning.message
    with pytest.raises(PeerDead, match=r"stall_timeout_s.*val-v10"):
        core.take(Reads(31.0, peers=peers, idle=True))
    # Answered in time: settled, nothing said.
    core = _resumed([], "heartbeat.stall_warn_s=10")
    core.version = 10
    core.published(20)
    core.end()
    assert core.take(Reads(9.0, validated=[ValidationFinished(
        request_id="val-v10", version=10, step=20, rank=0, metrics={})], idle=True)) == []
    assert core.settled


# ---------------------------------------------------------------------------- (e) heavy update


class _Worker:
    """A worker thread whose calls finish only when the test says so."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.pending: list[tuple[asyncio.Future[Any], Any, tuple[Any, ...]]] = []

    def submit(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((future, fn, args))
        return future

    def run_all(self) -> None:
        for future, fn, args in self.pending:
            future.set_result(fn(*args))
        self.pending = []

    # the step's calls (trainer.stepwork.StepCalls)
    def add(self, groups: Sequence[Sequence[Sample]]) -> None:
        self.calls.append(("add", len(groups)))

    def train(self) -> None:
        self.calls.append(("train", 0))

    def finish(self) -> dict[str, float]:
        self.calls.append(("finish", 0))
        return {"actor/loss": 0.25}


@pytest.mark.asyncio
async def test_a_heavy_update_finishes_the_step_only_when_the_worker_is_done() -> None:
    cfg = _cfg("async_training.require_batches=2")  # two mini-batches a step
    shell, worker = Shell(_core(cfg)), _Worker()
    work = StepWork(worker.submit, worker)
    shell.act(shell.core.issue(), 0.0)
    for action in shell.act(shell.core.start_step(1, 0.0), 0.0):
        assert not isinstance(action, Train)
    for ticket in (0, 1):
        for mini_batch in _trains(_answer(shell, ticket, 1.0)):
            work.add(mini_batch)
    assert worker.pending and work.running and not shell.core.gathered
    # The first mini-batch trains on and on: reads go on, nothing finishes, nothing the
    # step holds is judged lost however long it takes.
    for now in (10.0, 100.0, 1000.0):
        due = shell.core.due(now)
        assert 0 not in due.expired and 1 not in due.expired
        assert not any(isinstance(a, FinishStep)
                       for a in shell.take(Reads(now, idle=True, peers=[_hb(0, int(now))])))
    for ticket in (2, 3):
        for mini_batch in _trains(_answer(shell, ticket, 1001.0)):
            work.add(mini_batch)
    assert shell.core.gathered
    finished = asyncio.ensure_future(work.finish())
    await asyncio.sleep(0)
    assert not finished.done(), "the step waits for its mini-batches"
    worker.run_all()
    update = await finished
    assert worker.calls == [("add", 2), ("train", 0), ("add", 2), ("train", 0), ("finish", 0)]
    shell.core.close_step(profiled=False)
    out = shell.act(shell.core.finish_step(update, MEASURED, 1002.0), 1002.0)
    step = next(a.finished for a in out if isinstance(a, FinishStep))
    assert isinstance(step, StepFinished) and step.metrics["actor/loss"] == 0.25
    assert len(step.sample_ids) == 4 * N
