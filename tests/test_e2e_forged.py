"""Forged facts in a live run's log, with real processes and a real Redis (issue 22): readers
never fold them, and a log whose checkpoint file is gone is a fallback or one line.

The forged entries are XADDed to the run's events stream as any client with write access
could; each test asserts the outcome: the run finishes all its steps with no sample twice,
or the trainer exits non-zero with one line naming the file and a ComponentFailed event.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from rlbus.runlog import run_status
from runschema.messages import (
    ComponentFailed,
    RunFinished,
    StepFinished,
    TrainerResumed,
    WarningRaised,
)
from tests.procs import Procs, assert_every_step_once, events_of, run_args
from tests.waits import event, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]





async def test_a_forged_run_finished_mid_run_is_ignored(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """RunFinished(steps=10**9) written while the run is at step 4 of 12: both rollouters go
    on (saying why they ignore it), the run finishes all its steps, and the run's status
    (what `rlbus up` reads) is the trainer's RunFinished(12)."""
    steps = 12
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "rollout.replicas=2")
    procs.spawn("rollouter0", "rollouter", *args, "rollout.rank=0")
    procs.spawn("rollouter1", "rollouter", *args, "rollout.rank=1")
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=4), 120,
                   procs.watch("trainer"))
    await bus.publish(run_keys.events, RunFinished(run_id=run_id, steps=10**9))
    assert procs.wait("trainer", 180) == 0, procs.log("trainer")
    for name in ("rollouter0", "rollouter1"):
        assert procs.wait(name, 60) == 0, procs.log(name)
        assert "RunFinished(steps=1000000000) contradicts the log" in procs.log(name)
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    assert [e.steps for e in events if isinstance(e, RunFinished)] == [10**9, steps]
    status = await run_status(redis_url, run_id)
    # The status reads the stream only: retention may have archived the forgery by now.
    forged_in_stream = [m async for _, m in bus.read_all(run_keys.events)
                        if isinstance(m, RunFinished) and m.steps == 10**9]
    assert status.finished_steps == steps
    assert len(status.ignored) == len(forged_in_stream)


async def test_a_missing_checkpoint_is_one_line_then_a_fallback_resume(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """The trainer killed after step 6 (checkpoints 3 and 6). With every checkpoint file
    gone, a restart exits 1 with one line naming the file and a ComponentFailed, no
    traceback; with step 3's back, it resumes from it, re-applies steps 4-6 to the same
    model (weights_match) and finishes the run."""
    steps = 9
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "trainer.save_freq=3", "run.retention=all")
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=6), 120,
                   procs.watch("trainer"))
    procs.kill("trainer")
    ckpts = sorted(await asyncio.to_thread(lambda: list(tmp_path.rglob("step-*.pt"))))
    assert [p.name for p in ckpts][-2:] == ["step-000003.pt", "step-000006.pt"]
    aside = tmp_path / "aside"
    aside.mkdir()
    for p in ckpts:
        p.rename(aside / p.name)

    procs.spawn("trainer2", "trainer", *args)
    assert procs.wait("trainer2", 180) == 1, procs.log("trainer2")
    log = procs.log("trainer2")
    assert "Traceback" not in log, log
    assert "step-000006.pt named in the log is missing" in log
    failed = [e for e in await events_of(bus, run_keys.events)
              if isinstance(e, ComponentFailed) and e.role == "trainer"]
    assert len(failed) == 1 and "step-000006.pt" in failed[0].error

    three = next(p for p in ckpts if p.name == "step-000003.pt")
    (aside / three.name).rename(three)
    procs.spawn("trainer3", "trainer", *args)
    assert procs.wait("trainer3", 180) == 0, procs.log("trainer3")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    resumed = [e for e in events if isinstance(e, TrainerResumed)]
    assert len(resumed) == 1, resumed
    assert (resumed[0].checkpoint_step, resumed[0].replayed_steps) == (3, 3)
    assert resumed[0].weights_match is True
    assert any(isinstance(e, WarningRaised) and e.code == "checkpoint_missing"
               and "step-000006.pt" in e.message for e in events)
