"""``rlbus up``'s last line over a resumed run: the run's facts, not only this session's.

A resumed session's first step may already have the target reward; the line must not call
it the run's first (it said "reward >= 0.9 first at step 165" of a run that got there at
step 40). What the earlier sessions reached is folded from the log's stream
(rlbus.runlog.RunStatus, bounded: older steps are archived, and the line says so)."""

from __future__ import annotations

import math

from rlbus.runlog import RunStatus
from rlbus.watching import Summary
from runschema.messages import RunStarted, StepFinished


def _step(step: int, reward: float) -> StepFinished:
    return StepFinished(step=step, sample_ids=["t/0"], metrics={"critic/score/mean": reward},
                        duration_s=0.5)


def _status(*steps: StepFinished) -> RunStatus:
    status = RunStatus()
    for msg in (RunStarted(run_id="r", config={}), *steps):
        status.fold(msg)
    return status


def test_a_resumed_run_names_the_step_an_earlier_session_reached_the_target() -> None:
    status = _status(*(_step(k, 0.5 if k < 3 else 0.95) for k in range(1, 6)))
    assert (status.first_step, status.target_step, status.last_step) == (1, 3, 5)
    summary = Summary()
    summary.resumed(status.last_step, status.target_step, status.first_step)
    for k in (6, 7):
        summary.add(_step(k, 0.97), started=0.0)
    line = summary.line("r", 10, 3.0)
    assert "2 step(s) this session (of 10) in 3.0 s, resumed after step 5" in line, line
    assert "reward >= 0.9 first at step 3, before this session" in line, line
    assert "step 6" not in line


def test_a_stream_whose_oldest_steps_are_archived_says_so() -> None:
    status = _status(_step(40, 0.92), _step(41, 0.95))
    summary = Summary()
    summary.resumed(status.last_step, status.target_step, status.first_step)
    line = summary.line("r", 100, 1.0)
    assert ("reward >= 0.9 first at step 40, before this session (of the steps from 40 on: "
            "the older ones are archived)") in line, line


def test_a_target_reached_in_this_session_is_timed_from_its_start() -> None:
    status = _status(_step(1, 0.2), _step(2, 0.3))
    summary = Summary()
    summary.resumed(status.last_step, status.target_step, status.first_step)
    summary.add(_step(3, 0.5), started=0.0)
    summary.add(_step(4, 0.91), started=0.0)
    line = summary.line("r", 10, 1.0)
    assert "reward >= 0.9 first at step 4 (" in line and "s into this session)" in line, line
    fresh = Summary()  # a new run: no "resumed", no "into this session"
    fresh.add(_step(1, 0.95), started=0.0)
    assert "resumed" not in fresh.line("r", 10, 1.0)
    assert "into this session" not in fresh.line("r", 10, 1.0)


def test_a_log_written_before_the_trainer_kept_only_verls_name_still_says_its_reward() -> None:
    """Steps of an older build hold the reward only as ``reward/mean``: the summary, the
    progress line and inspect's line read it there (runschema.facts.step_reward)."""
    from rlbus.inspect import summary_line
    from runschema.facts import step_reward
    from runtime.progress import step_line

    def old(step: int, reward: float) -> StepFinished:
        return StepFinished(step=step, sample_ids=["t/0"], metrics={"reward/mean": reward},
                            duration_s=0.5)

    status = _status(old(1, 0.5), old(2, 0.93))
    assert status.target_step == 2
    summary = Summary()
    summary.add(old(1, 0.95), started=0.0)
    assert summary.last_reward == 0.95 and summary.target_step == 1
    assert "reward 0.950" in step_line(old(1, 0.95), 10)
    assert "reward=0.950" in summary_line("1700000000000-0", old(1, 0.95))
    # Both names (builds before the rename wrote both, equal): verl's is read. Neither: NaN.
    assert step_reward({"critic/score/mean": 0.25, "reward/mean": 0.75}) == 0.25
    assert math.isnan(step_reward({}))
