"""Events retention against a real redis-server: archive then trim (runtime.history), reading the
archive and the stream as one log, and the trainer's safe point (trainer.retention)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest

from bus import RUNS_STREAM, Bus, Fenced, RunKeys, pulse
from rlbus.profile import live_run_status, refusal_for
from runschema.messages import (
    FIELD,
    BlobRef,
    CheckpointSaved,
    Heartbeat,
    RunFinished,
    RunStarted,
    StepFinished,
    StepStarted,
    TicketsIssued,
    WeightsPublished,
)
from runtime.history import archive_below, events_folder, read_history
from storage.archive import append, read_archive
from trainer.resume import MAX_REFUSED_WARNINGS, Refused, Snapshot, read_log, refusal_warnings
from trainer.retention import checkpoints_to_drop, retain
from trainer.state import fold


async def _ids(bus: Bus, stream: str, folder: Path | None, start: str = "0") -> list[str]:
    return [e.id async for e in read_history(bus, stream, folder, start, count=7)]


async def _fill(bus: Bus, stream: str, n: int) -> list[str]:
    return [await bus.publish(stream, StepStarted(step=k, param_version=0)) for k in range(n)]


@pytest.mark.asyncio
async def test_archive_then_trim_reads_back_whole_in_order(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    stream, folder = run_keys.events, tmp_path / "events"
    ids = await _fill(bus, stream, 50)
    done = await archive_below(bus, stream, folder, ids[20], count=6)
    assert (done.archived, done.trimmed, done.cut) == (20, 20, ids[20])
    assert await bus.length(stream) == 30
    assert [e.id for e in read_archive(folder)] == ids[:20]
    assert await _ids(bus, stream, folder) == ids
    # From a position that was trimmed: the archive first, then the stream.
    assert await _ids(bus, stream, folder, ids[5]) == ids[6:]
    assert await _ids(bus, stream, folder, ids[19]) == ids[20:]
    assert await _ids(bus, stream, folder, ids[30]) == ids[31:]
    # A later trim archives only what is new.
    done = await archive_below(bus, stream, folder, ids[40])
    assert (done.archived, done.trimmed) == (20, 20)
    assert await _ids(bus, stream, folder) == ids
    assert await archive_below(bus, stream, folder, ids[40]) == (0, 0, None)


@pytest.mark.asyncio
async def test_a_crash_between_archive_and_trim_never_duplicates(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    stream, folder = run_keys.events, tmp_path / "events"
    ids = await _fill(bus, stream, 30)
    # The archive got entries 0..24 written, then the process died before XTRIM.
    page = await bus.read_page(stream, "0", f"({ids[25]}", count=100)
    append(folder, page[1])
    done = await archive_below(bus, stream, folder, ids[10])
    assert done.trimmed == 10
    assert [e.id for e in read_archive(folder)] == ids[:10]  # the rest is the stream's again
    assert await _ids(bus, stream, folder) == ids


@pytest.mark.asyncio
async def test_without_an_archive_a_trimmed_position_is_reported(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    stream = run_keys.events
    ids = await _fill(bus, stream, 12)
    await archive_below(bus, stream, tmp_path / "events", ids[6])
    gaps: list[tuple[str, str]] = []
    got = [e.id async for e in read_history(bus, stream, tmp_path / "elsewhere", ids[2],
                                            on_gap=lambda a, b: gaps.append((a, b)))]
    assert got == ids[6:] and gaps == [(ids[2], ids[6])]


@pytest.mark.asyncio
async def test_bad_archived_entries_are_skipped_like_bad_stream_entries(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    stream, folder = run_keys.events, tmp_path / "events"
    good = await bus.publish(stream, StepStarted(step=1, param_version=0))
    bad = await bus.publish_raw(stream, {FIELD: b"\xc1garbage"})
    last = await bus.publish(stream, StepStarted(step=2, param_version=0))
    await archive_below(bus, stream, folder, last)
    seen: list[str] = []
    got = [e.id async for e in read_history(bus, stream, folder,
                                            on_bad=lambda b: seen.append(b.id))]
    assert got == [good, last] and seen == [bad]


@pytest.mark.asyncio
async def test_a_live_readers_position_is_kept_and_a_dead_ones_is_not(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    stream, folder = run_keys.events, tmp_path / "events"
    ids = await _fill(bus, stream, 20)
    reader = run_keys.events_readers()[0]  # the profiler service
    await bus.set_position(run_keys.position("profiler"), ids[5])
    await pulse(bus, run_keys.alive("profiler", 0),
                Heartbeat(role="profiler", rank=0, pid=1), 30)
    done = await archive_below(bus, stream, folder, ids[15], readers=[reader])
    assert done.cut == ids[5] and await bus.length(stream) == 15
    await bus.delete(run_keys.alive("profiler", 0))  # the service is gone
    done = await archive_below(bus, stream, folder, ids[15], readers=[reader])
    assert done.cut == ids[15] and await bus.length(stream) == 5
    assert await _ids(bus, stream, folder) == ids


@pytest.mark.asyncio
async def test_the_trim_is_fenced_by_the_trainers_lease(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    stream = run_keys.events
    ids = await _fill(bus, stream, 5)
    await bus.command("SET", run_keys.trainer_lease, "host:1:new")
    with pytest.raises(Fenced):
        await bus.trim_log(stream, ids[3], fence=(run_keys.trainer_lease, "host:1:old"))
    assert await bus.length(stream) == 5
    assert await bus.trim_log(stream, ids[3], fence=(run_keys.trainer_lease, "host:1:new")) == 3


# --------------------------------------------------------------------------- trainer side


def _ref(version: int) -> BlobRef:
    return BlobRef(store="redis", key=f"w{version}", size=1, sha256=hashlib.sha256(b"").hexdigest())


async def _synthetic_run(bus: Bus, keys: RunKeys, run_dir: Path, steps: int, save_freq: int,
                         trigger: int) -> list[StepFinished]:
    """A trainer's log as it writes it: RunStarted, weights, tickets, steps, checkpoints
    with their snapshots (written as the trainer writes them: before CheckpointSaved)."""
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True)
    state = fold([])
    last_finished: str | None = None
    position = "0-0"
    finished: list[StepFinished] = []

    async def publish(msg: object) -> str:
        nonlocal state, position
        position = await bus.publish(keys.events, msg)  # type: ignore[arg-type]
        state = fold([msg], state)  # type: ignore[list-item]
        return position

    await publish(RunStarted(run_id=keys.run_id, config={"trainer": {"total_training_steps":
                                                                    steps}}))
    await publish(WeightsPublished(version=0, ref=_ref(0), step=0))
    for k in range(1, steps + 1):
        await publish(TicketsIssued(ticket_ids=[f"t{k}"], n=1, param_version=(k - 1) // trigger))
        await publish(StepStarted(step=k, param_version=(k - 1) // trigger))
        if k % trigger == 0:
            await publish(WeightsPublished(version=k // trigger, ref=_ref(k // trigger), step=k))
        if k % save_freq == 0:
            (folder / f"step-{k:06d}.pt").write_bytes(b"model")
            snap = Snapshot(state, position, last_finished)
            (folder / f"step-{k:06d}.state").write_bytes(msgspec.msgpack.encode(snap))
            await publish(CheckpointSaved(step=k, path=str(folder / f"step-{k:06d}.pt"),
                                          param_version=k // trigger))
        done = StepFinished(step=k, sample_ids=[f"t{k}/0"], metrics={"m": float(k)}, duration_s=0.1,
                            param_version=k // trigger, entry_ids=[f"{k}-0"])
        last_finished = await publish(done)
        finished.append(done)
    return finished


@pytest.mark.asyncio
async def test_retain_keeps_what_readers_need_and_resume_matches(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    run_dir = tmp_path / run_keys.run_id
    await _synthetic_run(bus, run_keys, run_dir, steps=30, save_freq=10, trigger=4)
    before = [e async for e in bus.read_all(run_keys.events)]
    whole = fold(e.msg for e in before)
    done = await retain(bus, run_keys, run_dir, keep_weights=3, keep_checkpoints=1,
                        last_step=30, current=whole.checkpoint()[1])
    assert done.events.trimmed > len(before) / 2
    kept = [e async for e in bus.read_all(run_keys.events)]
    kept_ids = {e.id for e in kept}
    # The newest snapshot's position and last StepFinished, so a resume reads after it.
    snap = msgspec.msgpack.decode(
        (run_dir / "checkpoints" / "step-000030.state").read_bytes(), type=Snapshot)
    assert snap.position in kept_ids and snap.last_finished_id in kept_ids
    # The newest three publications, for a starting rollouter.
    published = [e.id for e in before if isinstance(e.msg, WeightsPublished)]
    assert set(published[-3:]) <= kept_ids
    # Resume from the snapshot folds only the log after it, to the same state.
    read = await read_log(bus, run_keys, run_dir / "checkpoints")
    assert read.state == whole and read.entries_read < len(kept)
    # Without any snapshot, the archive and the stream fold to the same state too.
    for path in (run_dir / "checkpoints").glob("*.state"):
        path.unlink()
    assert (await read_log(bus, run_keys, run_dir / "checkpoints")).state == whole
    # Archive + stream: every event once, in order.
    history = [e.id async for e in read_history(
        bus, run_keys.events, events_folder(tmp_path, run_keys.run_id))]
    assert history == [e.id for e in before]
    # keep_checkpoints=1: step 30's, and step 20's that the step-30 snapshot's state names.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt")) == [
        "step-000020.pt", "step-000030.pt"]


@pytest.mark.asyncio
async def test_a_finished_run_keeps_its_last_step_and_end(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    run_dir = tmp_path / run_keys.run_id
    await _synthetic_run(bus, run_keys, run_dir, steps=20, save_freq=5, trigger=1)
    await bus.publish(run_keys.events, RunFinished(run_id=run_keys.run_id, steps=20))
    await retain(bus, run_keys, run_dir, keep_weights=3, keep_checkpoints=None, last_step=20,
                 current=None)
    kept = [e.msg async for e in bus.read_all(run_keys.events)]
    assert any(isinstance(m, StepFinished) and m.step == 20 for m in kept)
    assert isinstance(kept[-1], RunFinished)
    assert len(list((run_dir / "checkpoints").glob("*.pt"))) == 4  # null keeps all


def test_checkpoints_to_drop_keeps_the_newest_and_the_needed() -> None:
    assert checkpoints_to_drop([10, 20, 30, 40], 2, 40, set()) == [10, 20]
    assert checkpoints_to_drop([10, 20, 30, 40], 1, 40, {20}) == [10, 30]
    # A file of a step not finished (a crashed incarnation's) is never counted or deleted.
    assert checkpoints_to_drop([10, 20, 30, 40], 1, 30, set()) == [10, 20]
    assert checkpoints_to_drop([10], 3, 10, set()) == []


def test_resume_points_go_once_two_newer_checkpoints_exist() -> None:
    """The trainer's own checkpoints (trainer.resumepoints) are not the user's: deleted
    whatever max_actor_ckpt_to_keep says (None keeps every user checkpoint) once two newer
    checkpoints of either kind exist, and never counted against the user's N."""
    marked = frozenset({5, 15, 25, 35})
    steps = [5, 10, 15, 20, 25, 30, 35]
    assert checkpoints_to_drop(steps, None, 35, set(), marked) == [5, 15, 25]
    assert checkpoints_to_drop(steps, 1, 35, set(), marked) == [5, 10, 15, 20, 25]
    assert checkpoints_to_drop(steps, 2, 35, {25}, marked) == [5, 10, 15]
    assert checkpoints_to_drop([5, 10], None, 10, set(), frozenset({5})) == []


@pytest.mark.asyncio
async def test_rlbus_profile_sees_a_run_whose_run_started_was_archived(
    bus: Bus, redis_url: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    config = {"global_profiler": {"tool": "torch"}}
    started = RunStarted(run_id=run_keys.run_id, config=config)
    await bus.publish(run_keys.events, started)
    await bus.publish(RUNS_STREAM, started)
    ids = await _fill(bus, run_keys.events, 5)
    await archive_below(bus, run_keys.events, tmp_path / "events", ids[3])
    status = await live_run_status(redis_url, run_keys.run_id)
    assert status.started and status.config == config
    assert refusal_for(run_keys.run_id, status.started, status.finished_steps,
                       status.config) is None


def test_refused_events_are_warned_one_by_one_up_to_a_bound() -> None:
    refused = [Refused(entry_id=f"{i}-0", kind="StepFinished", reason="not the next step")
               for i in range(MAX_REFUSED_WARNINGS + 4)]
    warnings = refusal_warnings(refused)
    assert len(warnings) == MAX_REFUSED_WARNINGS + 1
    assert {w.code for w in warnings} == {"fact_refused"}
    assert warnings[0].message == "StepFinished at 0-0 not folded: not the next step"
    assert warnings[-1].message == "and 4 more events not folded"
    assert [w.message for w in refusal_warnings(refused[:2])] == [
        w.message for w in warnings[:2]]  # under the bound: no count
