"""The metrics logger follows from its stored position: a restart adds the new points only; and
the shared progress follower prints the same line as `rlbus up`."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest

from bus import Bus, Entry, RunKeys
from metrics_logger import MetricsLogger, logger_warnings, position_file, tensorboard_dir
from metrics_logger.app import Position, TensorBoardSink
from runconfig import load_config
from runschema.messages import RunFinished, RunStarted, StepFinished
from runtime.history import archive_below, events_folder
from runtime.progress import ProgressSpec, follow_progress, step_line


def _step(k: int) -> StepFinished:
    return StepFinished(step=k, sample_ids=[f"t{k}/0"], duration_s=0.1,
                        metrics={"critic/score/mean": k / 10, "staleness/mean": 0.5})


def _points(cfg_dir: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(cfg_dir))
    acc.Reload()
    return [e.step for e in acc.Scalars("critic/score/mean")]


@pytest.mark.asyncio
async def test_restart_continues_from_stored_position_without_duplicates(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    cfg = load_config(None, [f"run.id={run_id}", f"run.output_dir={tmp_path}"])
    events = RunKeys(run_id).events
    await bus.publish_many(events, [RunStarted(run_id=run_id, config={}),
                                    *(_step(k) for k in (1, 2, 3)),
                                    RunFinished(run_id=run_id, steps=3)])
    first = MetricsLogger(cfg, bus, [TensorBoardSink(tensorboard_dir(cfg))])
    assert await first.run() == 0 and first.written == 3
    assert position_file(cfg).is_file()
    # The run goes on (a resumed trainer; step 3 published again by a retried write).
    await bus.publish_many(events, [RunStarted(run_id=run_id, config={}, resumed=True),
                                    _step(3), _step(4), _step(5),
                                    RunFinished(run_id=run_id, steps=5)])
    second = MetricsLogger(cfg, bus, [TensorBoardSink(tensorboard_dir(cfg))])
    assert await second.run() == 0 and second.written == 2
    assert _points(tensorboard_dir(cfg)) == [1, 2, 3, 4, 5]


def test_logger_names_take_verl_values_and_warn_about_the_rest() -> None:
    cfg = load_config(None, ["trainer.logger=[console,tensorboard,mlflow]"])
    warnings = logger_warnings(cfg)
    assert len(warnings) == 1 and "'mlflow' is not supported" in warnings[0]
    assert load_config(None, ["trainer.logger=console"]).trainer.logger == "console"


@pytest.mark.asyncio
async def test_progress_follower_prints_each_new_step_only(
    bus: Bus, run_id: str
) -> None:
    events = RunKeys(run_id).events
    past = await bus.publish(events, _step(1))  # the follower starts after it
    out = io.StringIO()
    spec = ProgressSpec(run_id, 5, "trainer")
    task = asyncio.create_task(follow_progress(bus, spec, out, after=past))
    await bus.publish_many(events, [_step(2), _step(3), RunFinished(run_id=run_id, steps=3)])
    await asyncio.wait_for(task, 30)
    assert out.getvalue().splitlines() == [f"trainer: {step_line(_step(k), 5)}" for k in (2, 3)]


@pytest.mark.asyncio
async def test_a_periodic_progress_line_reads_a_backlog_at_once_and_shows_its_newest_step(
    bus: Bus, run_id: str
) -> None:
    """A role that prints every ``every_s`` reads what came meanwhile when its line is due
    (here 1,200 steps, more than one read's count) and prints the newest; a RunFinished
    ends it."""
    events = RunKeys(run_id).events
    past = await bus.publish(events, _step(1))
    await bus.publish_many(events, [_step(k) for k in range(2, 1201)])
    printed = asyncio.Event()

    class Out(io.StringIO):
        def write(self, text: str) -> int:
            printed.set()
            return super().write(text)

    out = Out()
    spec = ProgressSpec(run_id, 1200, "rollouter0", every_s=0.2)
    task = asyncio.create_task(follow_progress(bus, spec, out, after=past))
    await asyncio.wait_for(printed.wait(), 30)
    assert out.getvalue().splitlines()[0] == f"rollouter0: {step_line(_step(1200), 1200)}"
    await bus.publish(events, RunFinished(run_id=run_id, steps=1200))
    await asyncio.wait_for(task, 30)


@pytest.mark.asyncio
async def test_a_trimmed_position_is_read_from_the_archive_or_named_as_skipped(
    bus: Bus, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(None, [f"run.id={run_id}", f"run.output_dir={tmp_path}"])
    events = RunKeys(run_id).events
    await bus.publish_many(events, [RunStarted(run_id=run_id, config={}), _step(1), _step(2),
                                    RunFinished(run_id=run_id, steps=2)])
    first = MetricsLogger(cfg, bus, [TensorBoardSink(tensorboard_dir(cfg))])
    assert await first.run() == 0 and first.written == 2
    # While no logger runs, the run goes on and retention trims past the stored position.
    ids = await bus.publish_many(events, [RunStarted(run_id=run_id, config={}, resumed=True),
                                          *(_step(k) for k in range(3, 9)),
                                          RunFinished(run_id=run_id, steps=8)])
    done = await archive_below(bus, events, events_folder(tmp_path, run_id), ids[4])
    assert done.trimmed >= 5  # the stored position is gone from the stream
    second = MetricsLogger(cfg, bus, [TensorBoardSink(tensorboard_dir(cfg))])
    assert await second.run() == 0 and second.written == 6
    assert _points(tensorboard_dir(cfg)) == list(range(1, 9))
    # A logger without the archive (another machine) says which range it skipped.
    other = load_config(None, [f"run.id={run_id}", f"run.output_dir={tmp_path / 'other'}"])
    position_file(other).parent.mkdir(parents=True)
    position_file(other).write_bytes(msgspec.json.encode(Position(entry_id=ids[0], step=2)))
    third = MetricsLogger(other, bus, [])
    assert await third.run() == 0
    err = capsys.readouterr().err
    assert f"events after {ids[0]} up to {ids[4]} were trimmed" in err
    assert third.position.step == 8


@pytest.mark.asyncio
async def test_a_following_logger_commits_once_per_interval_and_at_the_end(
    bus: Bus, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps arriving one at a time are not each flushed and fsynced: the first batch commits,
    then none before the interval, and the last commit holds every step written."""
    import metrics_logger.app as app

    monkeypatch.setattr(app, "COMMIT_INTERVAL_S", 3600.0)
    cfg = load_config(None, [f"run.id={run_id}", f"run.output_dir={tmp_path}"])
    events = RunKeys(run_id).events
    await bus.publish(events, RunStarted(run_id=run_id, config={}))
    logger = MetricsLogger(cfg, bus, [TensorBoardSink(tensorboard_dir(cfg))])
    stored: list[Position] = []
    store = logger._store

    def counted(position: bytes, flush: bool) -> None:
        store(position, flush)
        stored.append(msgspec.json.decode(position, type=Position))

    monkeypatch.setattr(logger, "_store", counted)
    folded: asyncio.Queue[int] = asyncio.Queue()  # the last step after each batch folded
    fold = logger.follower.fold
    assert fold is not None

    def fold_and_tell(entries: Sequence[Entry]) -> None:
        fold(entries)
        folded.put_nowait(logger.position.step)

    logger.follower.fold = fold_and_tell
    run = asyncio.create_task(logger.run())
    for k in range(1, 6):
        await bus.publish(events, _step(k))
        while await asyncio.wait_for(folded.get(), 30) < k:  # folded before the next comes
            pass
    await bus.publish(events, RunFinished(run_id=run_id, steps=5))
    assert await asyncio.wait_for(run, 30) == 0
    assert len(stored) == 2 and stored[-1].step == 5
    on_disk = msgspec.json.decode(position_file(cfg).read_bytes(), type=Position)
    assert on_disk.step == 5 and on_disk.entry_id == logger.position.entry_id
    assert _points(tensorboard_dir(cfg)) == [1, 2, 3, 4, 5]
