"""A trainer never trains from scratch inside a run that has steps (issue 20: "a trainer
restarted on another node silently starts over").

The decision is pure (trainer.resume.not_covered, missing_checkpoint); read_log says what the
log holds beyond what it could fold (a real redis-server); and a real trainer restarted with a
``run.output_dir`` that lacks the run's checkpoints and archive is refused with exit 2, while
the same trainer on its own storage resumes and finishes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest

from bus import Bus, RunKeys
from runschema.messages import StepFinished
from tests.procs import Procs, assert_every_step_once, events_of, run_args
from tests.test_history import _synthetic_run
from tests.waits import event, wait_for, wait_trimmed
from trainer.resume import (
    LogRead,
    RunNotCovered,
    missing_checkpoint,
    not_covered,
    read_log,
)
from trainer.retention import retain
from trainer.state import TrainerState, fold


def _state(steps: int) -> TrainerState:
    return msgspec.structs.replace(TrainerState(), started=True, last_step=steps)


def test_a_fold_that_holds_every_logged_step_may_start() -> None:
    assert not_covered("r", LogRead(TrainerState(), None, None, 0), "/c", "/a") is None
    read = LogRead(_state(3), "3-0", "3-0", 9, log_last_step=3)
    assert not_covered("r", read, "/c", "/a") is None


def test_a_forged_step_in_a_log_read_whole_does_not_stop_a_resume() -> None:
    # The fold refused it (and the trainer reports it): the run's own steps are all there.
    read = LogRead(_state(5), "9-0", "8-0", 40, log_last_step=99)
    assert not_covered("r", read, "/c", "/a") is None


def test_steps_without_their_run_started_are_not_covered() -> None:
    read = LogRead(TrainerState(), "9-0", None, 12, log_last_step=27)
    why = not_covered("run-7", read, "/other/ckpt", "/other/events")
    assert why is not None
    assert "run-7" in why and "27" in why and "/other/ckpt" in why and "/other/events" in why


def test_a_trimmed_log_whose_archive_is_missing_is_not_covered() -> None:
    # Even when the part of the stream still in Redis names no step.
    read = LogRead(_state(0), "9-0", None, 4, archive_missing=True)
    why = not_covered("run-7", read, "/c", "/other/events")
    assert why is not None and "run-7" in why and "/other/events" in why


def test_a_log_whose_checkpoints_are_all_missing_is_not_covered() -> None:
    state = _state(4)
    assert missing_checkpoint("r", state, lambda _: True) is None  # no checkpoint named
    named = msgspec.structs.replace(state, checkpoint_at=(4, "/n1/ckpt/step-000004.pt"))
    assert missing_checkpoint("r", named, lambda p: p.endswith("4.pt")) is None
    why = missing_checkpoint("run-7", named, lambda _: False)
    assert why is not None and "run-7" in why and "/n1/ckpt/step-000004.pt" in why
    assert issubclass(RunNotCovered, Exception) and RunNotCovered.code == 2


@pytest.mark.asyncio
async def test_read_log_says_what_another_storage_cannot_restore(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    run_dir = tmp_path / "node1" / run_keys.run_id
    await _synthetic_run(bus, run_keys, run_dir, steps=30, save_freq=10, trigger=4)
    whole = fold([e.msg async for e in bus.read_all(run_keys.events)])
    done = await retain(bus, run_keys, run_dir, keep_weights=3, keep_checkpoints=1,
                        last_step=30, current=whole.checkpoint()[1])
    assert done.events.trimmed > 0
    # Its own storage: from the snapshot, or (no snapshot) from the archive, all covered.
    read = await read_log(bus, run_keys, run_dir / "checkpoints")
    assert read.state == whole and not_covered("r", read, "c", "a") is None
    for path in (run_dir / "checkpoints").glob("*.state"):
        path.unlink()
    read = await read_log(bus, run_keys, run_dir / "checkpoints")
    assert read.state == whole and not read.archive_missing
    assert not_covered("r", read, "c", "a") is None
    # Another storage (another node's run.output_dir): no snapshot, no archive.
    other = tmp_path / "node2" / run_keys.run_id
    read = await read_log(bus, run_keys, other / "checkpoints")
    assert read.archive_missing and read.log_last_step == 30 and read.state.last_step < 30
    why = not_covered(run_keys.run_id, read, str(other / "checkpoints"), str(other / "events"))
    assert why is not None and str(other / "events") in why
    assert f"written at {(run_dir / 'events').resolve()}" in why  # where the trimmer put it


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_trainer_restarted_on_a_storage_without_its_checkpoints_is_refused(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps = 8  # room after step 3 for the trim to be seen before the run ends
    first, other = tmp_path / "node1", tmp_path / "node2"
    more = (f"trainer.total_training_steps={steps}", "trainer.save_freq=2",
            "run.retention=checkpoint")
    args = run_args(redis_url, run_id, first, *more)
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=3), 180,
                   procs.watch("trainer"))
    # The case under test is a log trimmed after the step-2 checkpoint (its archive on node 1
    # only): killed before the trim, the trainer elsewhere reads the whole log and fails on
    # the missing checkpoint instead (exit 1, test_e2e_forged's case).
    await wait_trimmed(bus, run_keys.events, 60, procs.watch("trainer"))
    procs.kill("trainer")
    logged = max(e.step for e in await events_of(bus, run_keys.events)
                 if isinstance(e, StepFinished))
    # Another node: its run.output_dir holds neither the checkpoints nor the archive, and
    # the first node's disk is not there (the log names checkpoints by their paths there).
    away = tmp_path / "node1-away"
    first.rename(away)
    procs.spawn("trainer_elsewhere", "trainer", *run_args(redis_url, run_id, other, *more))
    assert procs.wait("trainer_elsewhere", 180) == 2, procs.log("trainer_elsewhere")
    away.rename(first)
    said = procs.log("trainer_elsewhere")
    assert run_id in said and (str(other / run_id) in said or str(first) in said), said
    assert f"steps up to {logged}" in said or f"up to step {logged}" in said, said
    assert "Traceback" not in said, said
    events = await events_of(bus, run_keys.events)
    assert all(e.step <= logged for e in events if isinstance(e, StepFinished))
    # On its own storage the run resumes and finishes, every step once.
    shutil.rmtree(other, ignore_errors=True)
    procs.spawn("trainer2", "trainer", *args)
    assert procs.wait("trainer2", 240) == 0, procs.log("trainer2")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    assert_every_step_once(await events_of(bus, run_keys.events), steps)
