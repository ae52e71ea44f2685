"""Events retention end to end (run.retention=checkpoint), with a real trainer and rollouter:
the events stream stays bounded, the archive and the stream together hold every event once
and in order, a trainer killed right after a trim resumes with the weights it had, old
checkpoints are deleted, and ``rlbus inspect`` still shows every step."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runschema.messages import CheckpointSaved, StepFinished, StepStarted, TrainerResumed
from runtime import Follower
from runtime.history import events_folder, read_history
from storage.archive import read_archive
from tests.procs import FAST, Procs, run_cli
from tests.waits import event, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]


@pytest.fixture
def procs(tmp_path: Path):
    p = Procs(tmp_path / "logs")
    yield p
    p.kill_all()


async def _record(bus: Bus, stream: str, seen: list[str], stop: asyncio.Event) -> None:
    """Every entry of ``stream`` as it is written (a live reader is never trimmed past: the
    safe point trails the newest checkpoint)."""
    follower = Follower(bus, stream, fold=lambda entries: seen.extend(e.id for e in entries))
    while not stop.is_set():
        await follower.poll(block_ms=200)


async def _rest(bus: Bus, stream: str, after: str) -> list:
    return [e async for e in bus.read_all(stream, start=f"({after}")]


async def test_events_stay_bounded_and_archive_plus_stream_hold_every_event(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps = 40
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}", *FAST,
            f"trainer.total_training_steps={steps}", "trainer.save_freq=10",
            "trainer.max_actor_ckpt_to_keep=2"]
    seen: list[str] = []
    stop = asyncio.Event()
    recorder = asyncio.create_task(_record(bus, run_keys.events, seen, stop))
    archive = events_folder(tmp_path, run_id)
    try:
        procs.spawn("rollouter0", "rollouter", *args)
        procs.spawn("trainer", "trainer", *args)
        # The trim after step 20's checkpoint ends before step 21 starts: kill the trainer
        # right after it.
        await wait_for(bus, run_keys.events, event(StepStarted, step=21), 300,
                       procs.watch("trainer", "rollouter0"))
        procs.kill("trainer")
        assert list(read_archive(archive)), "nothing was archived after two checkpoints"
        procs.spawn("trainer2", "trainer", *args)
        # Waited for on a thread: the recorder keeps reading meanwhile.
        assert await asyncio.to_thread(procs.wait, "trainer2", 300) == 0, procs.log("trainer2")
        assert await asyncio.to_thread(procs.wait, "rollouter0", 60) == 0, (
            procs.log("rollouter0"))
    finally:
        stop.set()
        await asyncio.wait_for(recorder, 30)
    # What the recorder had not read yet when it stopped (the run is over: nothing trims).
    seen += [e.id for e in await _rest(bus, run_keys.events, seen[-1])]

    history = [e async for e in read_history(bus, run_keys.events, archive)]
    # Archive + stream: every event exactly once, in log order.
    assert [e.id for e in history] == seen
    archived = [e.id for e in read_archive(archive)]
    length = await bus.length(run_keys.events)
    assert archived and length + len(archived) == len(seen)
    # Bounded: the stream keeps a checkpoint window or two (below the newest snapshot, and
    # below what each reader last stored at its pulse, which may lag a pulse behind), never
    # the run's beginning: the first window (through step 10) is in the archive only. (How
    # many windows it keeps depends on where the readers' pulses fell: not asserted.)
    first_window = next(e.id for e in history
                        if isinstance(e.msg, StepFinished) and e.msg.step == 10)
    early = seen[:seen.index(first_window) + 1]
    assert set(early) <= set(archived)
    assert length <= len(seen) - len(early), (length, len(seen))
    # The resumed trainer rebuilt the model it had published.
    resumed = [e.msg for e in history if isinstance(e.msg, TrainerResumed)]
    assert len(resumed) == 1 and resumed[0].weights_match is True
    assert resumed[0].checkpoint_step == 20
    finished = {e.msg.step for e in history if isinstance(e.msg, StepFinished)}
    assert finished == set(range(1, steps + 1))
    # max_actor_ckpt_to_keep=2: the newest two (plus, at most, the one the newest snapshot
    # names, which is one of them here).
    ckpts = sorted(p.name for p in (tmp_path / run_id / "checkpoints").glob("step-*.pt"))
    assert ckpts == ["step-000030.pt", "step-000040.pt"]
    assert sorted(p.name for p in (tmp_path / run_id / "checkpoints").glob("step-*.state")) == [
        "step-000030.state", "step-000040.state"]

    # rlbus inspect reads the archive and the stream as one log: every step 1..N.
    res = run_cli("inspect", "--run", run_id, "--json", f"redis.url={redis_url}",
                  f"run.output_dir={tmp_path}")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert sorted({r["step"] for r in rows if r["type"] == "StepFinished"}) == list(
        range(1, steps + 1))
    # Every event of the trainer's log (the rollouters' claims are in their own streams).
    trainers = [r for r in rows if r["type"] != "TicketsClaimed"]
    assert len(trainers) == len([e for e in history if type(e.msg).__name__ != "Heartbeat"])


async def test_save_freq_minus_one_is_bounded_by_resume_points_that_serve_a_resume(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """verl's default ``trainer.save_freq=-1``: no checkpoint is asked for, yet the samples
    stream stays bounded. The trainer writes its own resume points (every 4 steps here), the
    streams are trimmed after each, a trainer killed after step 14 resumes from step 12's
    with the weights it had, and at the end only the newest resume points are left beside the
    run's last checkpoint."""
    steps, per_step = 30, 4 * 4  # FAST: 4 groups of n=4 a step
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}", *FAST,
            f"trainer.total_training_steps={steps}", "trainer.save_freq=-1",
            "run.resume_point_steps=4"]
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=14), 300,
                   procs.watch("trainer", "rollouter0"))
    procs.kill("trainer")
    # Trimmed below step 8's samples (the fallback of step 12's resume point): steps 9-14
    # and what the rollouter generated ahead, not the 14 steps trained.
    assert await bus.length(run_keys.samples) <= 10 * per_step
    procs.spawn("trainer2", "trainer", *args)
    assert await asyncio.to_thread(procs.wait, "trainer2", 300) == 0, procs.log("trainer2")
    assert await asyncio.to_thread(procs.wait, "rollouter0", 60) == 0, procs.log("rollouter0")

    history = [e.msg async for e in read_history(bus, run_keys.events,
                                                 events_folder(tmp_path, run_id))]
    points = sorted({m.step for m in history if isinstance(m, CheckpointSaved)
                     and m.resume_point})
    assert points == list(range(4, steps, 4)), points
    resumed = [m for m in history if isinstance(m, TrainerResumed)]
    assert len(resumed) == 1 and resumed[0].checkpoint_step == 12, resumed
    assert resumed[0].weights_match is True
    assert {m.step for m in history if isinstance(m, StepFinished)} == set(range(1, steps + 1))
    assert await bus.length(run_keys.samples) <= 6 * per_step
    folder = tmp_path / run_id / "checkpoints"
    names = await asyncio.to_thread(lambda: sorted(p.name for p in folder.iterdir()
                                                   if p.name.startswith("step-")))
    assert names == ["step-000028.pt", "step-000028.resume", "step-000028.state",
                     "step-000030.pt", "step-000030.state"], names
