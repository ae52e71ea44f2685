"""Checkpoints on a remote run storage (trainer.mirror): what is uploaded, fetched and
deleted, the mirror on a storage that is not local to runconfig.paths (the ``rlbustest``
protocol: a LocalFileSystem under another name), and a trainer restarted on another node
that resumes from the storage's copy."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from bus import Bus, RunKeys
from runconfig import load_config
from runconfig.paths import checkpoint_dir, local_path
from runschema.messages import RunStarted, StepFinished, TrainerResumed
from runtime.events_archive import RECORD_SEGMENT, fetch_for_reading, segments_to_read
from storage.run_storage import RunStorage
from tests.procs import Procs, assert_every_step_once, events_of, run_args, run_cli
from tests.waits import event, wait_for, wait_trimmed
from trainer.mirror import (
    CheckpointMirror,
    EventsMirror,
    checkpoint_mirror,
    remote_names,
    segments_to_fetch,
    segments_to_push,
    to_download,
    upload_order,
)

PROTOCOL = "rlbustest"

# The same class in this process and (through sitecustomize) in the component processes.
_FS_SOURCE = textwrap.dedent('''
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class RlbusTestFileSystem(LocalFileSystem):
        """Local files under a protocol that runconfig.paths does not take as local."""

        protocol = ("rlbustest",)

        def __init__(self, **kwargs):
            super().__init__(**{**kwargs, "auto_mkdir": True})  # an object store's puts

    fsspec.register_implementation("rlbustest", RlbusTestFileSystem, clobber=True)
''')


class RlbusTestFileSystem(LocalFileSystem):
    """Local files under a protocol that runconfig.paths does not take as local."""

    protocol = (PROTOCOL,)

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**{**kwargs, "auto_mkdir": True})  # an object store's puts


fsspec.register_implementation(PROTOCOL, RlbusTestFileSystem, clobber=True)


def test_a_checkpoint_uploads_its_pt_before_its_state() -> None:
    assert upload_order(Path("/c/step-000004.pt")) == [Path("/c/step-000004.pt"),
                                                       Path("/c/step-000004.state")]


def test_only_whole_remote_pairs_the_local_folder_lacks_are_fetched() -> None:
    remote = ["step-000002.pt", "step-000002.state", "step-000004.pt", "step-000004.state",
              "step-000006.pt", "other.txt"]  # step 6: an upload cut short
    assert to_download(remote, []) == ["step-000002.pt", "step-000002.state",
                                       "step-000004.pt", "step-000004.state"]
    assert to_download(remote, ["step-000002.pt", "step-000002.state", "step-000004.state"]
                       ) == ["step-000004.pt"]
    assert to_download(remote, remote) == []


def test_remote_copies_are_deleted_snapshot_first() -> None:
    assert remote_names([4, 2]) == ["step-000002.state", "step-000002.pt",
                                    "step-000004.state", "step-000004.pt"]


def test_the_storages_archive_replaces_a_stale_local_one() -> None:
    remote = {"archive-000001.rlev": 100, "archive-000002.rlev": 50, ".lock": 0}
    assert segments_to_fetch(remote, {}) == (["archive-000001.rlev", "archive-000002.rlev"], [])
    local = {"archive-000001.rlev": 100, "archive-000002.rlev": 20, "archive-000003.rlev": 9,
             ".lock": 0}
    assert segments_to_fetch(remote, local) == (["archive-000002.rlev"], ["archive-000003.rlev"])
    assert segments_to_fetch({}, local) == ([], [])  # nothing mirrored yet: keep local


def test_a_reader_only_adds_what_the_storage_holds_more_of() -> None:
    seg = "archive-{:06d}.rlev".format
    remote = {seg(1): 50, seg(2): 30, seg(3): 20, "other.txt": 5}
    # Missing (3) and shorter here (2) are fetched; a longer local one (1, the trainer of
    # this node appended to it) is kept; a local one the storage lacks (9) is not removed.
    assert segments_to_read(remote, {seg(1): 70, seg(2): 10, seg(9): 4}) == [seg(2), seg(3)]
    assert segments_to_read({}, {seg(1): 7}) == []


def test_a_reader_fetches_from_a_remote_storage_only(tmp_path: Path) -> None:
    seg = "archive-{:06d}.rlev".format
    remote = tmp_path / "remote" / "r1" / "events"
    remote.mkdir(parents=True)
    for name, data in ((seg(1), b"a" * 5), (seg(2), b"b" * 3)):
        (remote / name).write_bytes(data)
    here = tmp_path / "out" / "r1" / "events"
    here.mkdir(parents=True)
    (here / seg(1)).write_bytes(b"x" * 9)  # appended to since the last upload: kept
    (here / seg(7)).write_bytes(b"y")  # not uploaded yet: kept
    cfg = load_config(None, [f"run.output_dir={tmp_path / 'out'}",
                            f"run.storage={PROTOCOL}://{tmp_path / 'remote'}"])
    assert fetch_for_reading(cfg, "r1") == [seg(2)]
    assert (here / seg(2)).read_bytes() == b"bbb" and (here / seg(1)).read_bytes() == b"x" * 9
    assert (here / seg(7)).exists() and sorted(p.name for p in remote.iterdir()) == [seg(1), seg(2)]
    local = load_config(None, [f"run.output_dir={tmp_path / 'out'}",
                               f"run.storage={tmp_path / 'remote'}"])
    assert fetch_for_reading(local, "r1") == []  # a local storage is read in place


def test_a_push_sends_what_changed_and_drops_what_was_truncated() -> None:
    sent = {"archive-000001.rlev": 100, "archive-000002.rlev": 50}
    local = {"archive-000001.rlev": 100, "archive-000002.rlev": 80, ".lock": 0}
    assert segments_to_push(local, sent) == (["archive-000002.rlev"], [])
    assert segments_to_push({"archive-000001.rlev": 60}, sent) == (
        ["archive-000001.rlev"], ["archive-000002.rlev"])
    assert segments_to_push(local, {}) == (["archive-000001.rlev", "archive-000002.rlev"], [])


def test_the_events_mirror_pushes_and_fetches(tmp_path: Path) -> None:
    storage = RunStorage(f"{PROTOCOL}://{tmp_path / 'remote'}")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "archive-000001.rlev").write_bytes(b"one")
    (a / ".lock").write_bytes(b"")
    on_a = EventsMirror(storage, a, "r1/events")
    on_a.push()
    (a / "archive-000001.rlev").write_bytes(b"one more")
    on_a.push()
    assert storage.sizes("r1/events") == {"archive-000001.rlev": 8}
    b.mkdir()
    (b / "archive-000007.rlev").write_bytes(b"stale")
    assert EventsMirror(storage, b, "r1/events").fetch() == ["archive-000001.rlev"]
    assert sorted(p.name for p in b.iterdir()) == ["archive-000001.rlev"]
    assert (b / "archive-000001.rlev").read_bytes() == b"one more"


def test_the_records_segments_mirror_like_the_archives(tmp_path: Path) -> None:
    storage = RunStorage(f"{PROTOCOL}://{tmp_path / 'remote'}")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "samples-000001.parquet").write_bytes(b"one")
    (a / "validation-000002-v2-r0.parquet").write_bytes(b"a rollouter's, not mirrored")
    (a / "archive-000001.rlev").write_bytes(b"not a record segment")
    EventsMirror(storage, a, "r1/record", RECORD_SEGMENT).push()
    assert storage.sizes("r1/record") == {"samples-000001.parquet": 3}
    b.mkdir()
    (b / "samples-000009.parquet").write_bytes(b"never uploaded: its samples were not trimmed")
    assert EventsMirror(storage, b, "r1/record", RECORD_SEGMENT).fetch() == [
        "samples-000001.parquet"]
    assert sorted(p.name for p in b.iterdir()) == ["samples-000001.parquet"]
    cfg = load_config(None, [f"run.output_dir={tmp_path / 'out'}",
                            f"run.storage={PROTOCOL}://{tmp_path / 'remote'}"])
    assert fetch_for_reading(cfg, "r1", record=True) == ["samples-000001.parquet"]
    assert (tmp_path / "out" / "r1" / "record" / "samples-000001.parquet").read_bytes() == b"one"


def test_the_test_protocol_is_remote_to_the_paths(tmp_path: Path) -> None:
    url = f"{PROTOCOL}://{tmp_path}"
    assert local_path(url) is None and not RunStorage(url).local
    cfg = load_config(None, [f"run.output_dir={tmp_path / 'out'}", f"run.storage={url}"])
    mirror = checkpoint_mirror(cfg, "r1")
    assert mirror is not None and mirror.folder == checkpoint_dir(cfg, "r1")
    assert checkpoint_mirror(load_config(None, [f"run.storage=file://{tmp_path}"]), "r1") is None


def test_the_mirror_uploads_fetches_and_deletes(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    storage = RunStorage(f"{PROTOCOL}://{remote}")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    for step in (2, 4):
        (a / f"step-{step:06d}.pt").write_bytes(b"model %d" % step)
        (a / f"step-{step:06d}.state").write_bytes(b"state %d" % step)
        CheckpointMirror(storage, a, "r1/checkpoints").upload(a / f"step-{step:06d}.pt")
    assert storage.list("r1/checkpoints") == ["step-000002.pt", "step-000002.state",
                                              "step-000004.pt", "step-000004.state"]
    on_b = CheckpointMirror(storage, b, "r1/checkpoints")
    assert on_b.download_missing() == ["step-000002.pt", "step-000002.state",
                                       "step-000004.pt", "step-000004.state"]
    assert (b / "step-000004.pt").read_bytes() == b"model 4"
    assert sorted(p.name for p in b.iterdir()) == storage.list("r1/checkpoints")  # no .part
    assert on_b.download_missing() == []
    assert on_b.locate(str(a / "step-000004.pt")) == str(b / "step-000004.pt")
    on_b.delete([2])
    assert storage.list("r1/checkpoints") == ["step-000004.pt", "step-000004.state"]


def _sitecustomize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The component processes know the test protocol (registered at interpreter start)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FS_SOURCE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))

async def _killed_after_step_3(procs: Procs, bus: Bus, run_keys: RunKeys, args: list[str],
                               timeout_s: float) -> None:
    """Node A's run (a rollouter and the trainer on ``args``) until step 3, then its trainer
    SIGKILLed."""
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=3), timeout_s,
                   procs.watch("trainer"))
    procs.kill("trainer")


def _finish_on_node_b(procs: Procs, node_a: Path, node_b: Path, args: list[str]) -> None:
    """Node A's disk is away while trainer B (on ``node_b``) finishes the run from the
    storage; then the rollouter (on node A) finishes too."""
    away = node_a.with_name(node_a.name + "-away")
    node_a.rename(away)
    procs.spawn("trainer_b", "trainer", *args)
    assert procs.wait("trainer_b", 240) == 0, procs.log("trainer_b")
    away.rename(node_a)
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")



@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_trainer_on_another_node_resumes_from_the_remote_checkpoint(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """run.storage=rlbustest://...: the trainer on node A uploads its checkpoints; killed,
    a trainer on node B (another run.output_dir, node A's disk gone) fetches them and
    resumes, every step once."""
    _sitecustomize(tmp_path, monkeypatch)
    remote, node_a, node_b = tmp_path / "remote", tmp_path / "nodeA", tmp_path / "nodeB"
    more = ("trainer.total_training_steps=4", "trainer.save_freq=2", "run.retention=all",
            f"run.storage={PROTOCOL}://{remote}")
    await _killed_after_step_3(procs, bus, run_keys, run_args(redis_url, run_id, node_a, *more),
                               180)
    mirrored = remote / run_id / "checkpoints"
    assert (mirrored / "step-000002.pt").is_file() and (mirrored / "step-000002.state").is_file()
    # Node A's disk is not on node B: the log names its checkpoints by their paths there.
    _finish_on_node_b(procs, node_a, node_b, run_args(redis_url, run_id, node_b, *more))
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, 4)
    assert [e.resumed for e in events if isinstance(e, RunStarted)] == [False, True]
    resumed = [e for e in events if isinstance(e, TrainerResumed)]
    assert resumed and resumed[0].checkpoint_step == 2 and resumed[0].weights_match is True
    assert (node_b / run_id / "checkpoints" / "step-000002.pt").is_file()  # fetched
    assert (mirrored / "step-000004.pt").is_file() and (mirrored / "step-000004.state").is_file()


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_two_ranks_write_their_dcp_shards_to_the_remote_storage_and_resume_from_it(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """run.storage=rlbustest://... with 2 trainer ranks (checkpoint_format auto: dcp): each
    rank writes its shard into the storage's step-K.dcp, no node keeps one; killed, a
    trainer on node B (node A's disk gone) reads them from there and resumes with
    weights_match; retention deletes the dropped checkpoints' shards there too."""
    _sitecustomize(tmp_path, monkeypatch)
    remote, node_a, node_b = tmp_path / "remote", tmp_path / "nodeA", tmp_path / "nodeB"
    more = ("trainer.total_training_steps=6", "trainer.save_freq=2", "trainer.n_gpus_per_node=2",
            "run.retention=checkpoint", "trainer.max_actor_ckpt_to_keep=1",
            f"run.storage={PROTOCOL}://{remote}")
    await _killed_after_step_3(procs, bus, run_keys, run_args(redis_url, run_id, node_a, *more),
                               240)
    mirrored = remote / run_id / "checkpoints"
    shards = sorted(p.name for p in (mirrored / "step-000002.dcp").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards  # one per rank, both there
    _finish_on_node_b(procs, node_a, node_b, run_args(redis_url, run_id, node_b, *more))
    events = await events_of(bus, run_keys.events)
    resumed = [e for e in events if isinstance(e, TrainerResumed)]
    assert resumed and resumed[0].checkpoint_step == 2 and resumed[0].weights_match is True
    assert not list((node_b / run_id / "checkpoints").glob("*.dcp"))  # read from the storage
    assert not list((node_a / run_id / "checkpoints").glob("*.dcp"))
    # Retention dropped step 2 (kept: the newest, and what the trimmed log needs): its
    # shards went with its files; every checkpoint left has its shards beside it.
    kept = sorted(p.name for p in mirrored.glob("step-*"))
    local = sorted(p.name for p in (node_b / run_id / "checkpoints").glob("step-*"))
    assert "step-000002.pt" not in kept and "step-000006.pt" in kept, kept
    assert kept == sorted([*local, *(n.replace(".pt", ".dcp") for n in local
                                     if n.endswith(".pt"))]), (kept, local)


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_retention_deletes_the_remote_copies_of_dropped_checkpoints(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _sitecustomize(tmp_path, monkeypatch)
    remote, out = tmp_path / "remote", tmp_path / "out"
    args = run_args(redis_url, run_id, out, "trainer.total_training_steps=4",
                    "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=1",
                    "run.retention=checkpoint", f"run.storage={PROTOCOL}://{remote}")
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    assert procs.wait("trainer", 240) == 0, procs.log("trainer")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    assert_every_step_once(await events_of(bus, run_keys.events), 4)
    local = sorted(p.name for p in (out / run_id / "checkpoints").glob("step-*"))
    mirrored = sorted(p.name for p in (remote / run_id / "checkpoints").glob("step-*"))
    assert "step-000004.pt" in local and "step-000001.pt" not in local, local
    assert mirrored == local
    # Another node (another empty run.output_dir, this node's disk gone) inspects the run:
    # the trimmed beginning of the log comes from the storage's copy of the archive.
    assert await bus.get_text(run_keys.archive), "the trainer never trimmed the stream"
    assert list((remote / run_id / "events").glob("archive-*.rlev"))
    away, other = tmp_path / "out-away", tmp_path / "other"
    out.rename(away)
    shown = run_cli("inspect", "--run", run_id, "--json", f"redis.url={redis_url}",
                    f"run.output_dir={other}", f"run.storage={PROTOCOL}://{remote}")
    away.rename(out)
    assert shown.returncode == 0, shown.stderr
    steps = [e["step"] for line in shown.stdout.splitlines()
             if (e := json.loads(line)).get("type") == "StepFinished"]
    assert sorted(set(steps)) == [1, 2, 3, 4], shown.stderr
    assert list((other / run_id / "events").glob("archive-*.rlev"))  # fetched there


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_trimming_trainer_on_another_node_resumes_with_the_whole_log(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """run.retention=checkpoint: node A's trainer archived and trimmed the log; on node B
    (node A's disk gone) the checkpoints and the archive are fetched from the storage, and
    the run's whole log (archive + stream) still holds every step once."""
    _sitecustomize(tmp_path, monkeypatch)
    node_a, node_b = tmp_path / "nodeA", tmp_path / "nodeB"
    remote = tmp_path / "remote"
    more = ("trainer.total_training_steps=8", "trainer.save_freq=2",
            "run.retention=checkpoint", f"run.storage={PROTOCOL}://{remote}")
    procs.spawn("rollouter0", "rollouter", *run_args(redis_url, run_id, node_a, *more))
    procs.spawn("trainer", "trainer", *run_args(redis_url, run_id, node_a, *more))
    # The archive's location is stored before its first segment is written, copied to the
    # storage and the stream trimmed: wait for the trim, which comes after the copy.
    await wait_trimmed(bus, run_keys.events, 180, procs.watch("trainer"))
    procs.kill("trainer")
    assert list((remote / run_id / "events").glob("archive-*.rlev"))  # copied before the trim
    _finish_on_node_b(procs, node_a, node_b, run_args(redis_url, run_id, node_b, *more))
    said = procs.log("trainer_b")
    assert "events archive segments" in said, said
    # The log as a reader finds it: node B's archive (recorded last) and the stream.
    assert await bus.get_text(run_keys.archive) == str((node_b / run_id / "events").resolve())
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, 8)
    assert [e.resumed for e in events if isinstance(e, RunStarted)] == [False, True]
    # The run's record went the same way (issue 39): node A's segments were on the storage
    # before their samples were trimmed, node B fetched them and went on: every trained
    # sample of the 8 steps once, on node B and on the storage.
    from storage.record import read_rows

    assert list((remote / run_id / "record").glob("samples-*.parquet"))
    rows = [r for r in read_rows(node_b / run_id / "record",
                                 columns=["entry_id", "step", "verdict"])]
    assert len({r["entry_id"] for r in rows}) == len(rows)
    trained = sorted(r["step"] for r in rows if r["verdict"] == "trained")
    finished = {e.step: len(e.sample_ids) for e in events if isinstance(e, StepFinished)}
    assert trained == sorted(s for s, n in finished.items() for _ in range(n))
    assert sorted(p.name for p in (remote / run_id / "record").iterdir()) == sorted(
        p.name for p in (node_b / run_id / "record").glob("samples-*.parquet"))
