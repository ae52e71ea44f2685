"""The run's storage (``run.storage``): paths derived from the config, RunStorage on a local
path and a ``file://`` URL, and the check every component makes at start (exit 2 naming the
URL and the reason)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runconfig import load_config
from runconfig.paths import (
    blob_root,
    checkpoint_dir,
    events_dir,
    local_path,
    local_root,
    storage_root,
    storage_url,
)
from runschema.messages import StepFinished, TrainerResumed
from runtime.storage import check_storage
from storage.run_storage import PROBE_PREFIX, RunStorage, StorageError
from tests.procs import Procs, assert_every_step_once, events_of, run_args, run_cli
from tests.waits import event, wait_for


def test_null_storage_keeps_the_output_dir_layout(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={tmp_path}"])
    assert cfg.run.storage is None and storage_url(cfg) == str(tmp_path)
    assert checkpoint_dir(cfg, "r1") == tmp_path / "r1" / "checkpoints"
    assert events_dir(cfg, "r1") == tmp_path / "r1" / "events"
    assert blob_root(cfg, "r1") == tmp_path / "r1" / "blobs"


def test_a_local_storage_holds_the_run_files(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={tmp_path / 'out'}",
                             f"run.storage=file://{tmp_path / 'shared'}"])
    assert local_root(cfg, "r1") == tmp_path / "shared" / "r1"
    assert checkpoint_dir(cfg, "r1") == tmp_path / "shared" / "r1" / "checkpoints"
    assert events_dir(cfg, "r1") == tmp_path / "shared" / "r1" / "events"
    assert blob_root(cfg, "r1") == tmp_path / "shared" / "r1" / "blobs"


def test_a_remote_storage_holds_the_weights_and_local_files_stay_in_output_dir(
    tmp_path: Path,
) -> None:
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.storage=s3://bucket/runs/"])
    assert local_path("s3://bucket/runs") is None
    assert storage_root(cfg, "r1") == "s3://bucket/runs/r1"
    assert blob_root(cfg, "r1") == "s3://bucket/runs/r1/blobs"
    assert checkpoint_dir(cfg, "r1") == tmp_path / "r1" / "checkpoints"
    assert events_dir(cfg, "r1") == tmp_path / "r1" / "events"


@pytest.mark.parametrize("as_url", [False, True])
def test_run_storage_reads_writes_lists_and_deletes(tmp_path: Path, as_url: bool) -> None:
    root = tmp_path / "store"
    store = RunStorage(f"file://{root}" if as_url else str(root))
    assert store.local and store.list("ckpt") == [] and not store.exists("ckpt/a")
    store.write_bytes("ckpt/a", b"one")
    store.write_bytes("ckpt/b", b"two")
    store.write_bytes("ckpt/a", b"three")  # replaced whole
    assert (root / "ckpt" / "a").read_bytes() == b"three"
    assert store.read_bytes("ckpt/b") == b"two" and store.exists("ckpt/a")
    assert store.list("ckpt") == ["a", "b"]
    # An atomic write leaves no temporary file behind.
    assert sorted(os.listdir(root / "ckpt")) == ["a", "b"]
    store.delete("ckpt/a")
    store.delete("ckpt/a")  # already gone: nothing
    assert store.list("ckpt") == ["b"]
    with pytest.raises(FileNotFoundError):
        store.read_bytes("ckpt/a")
    with pytest.raises(ValueError):
        store.write_bytes("../escape", b"x")
    store.write_bytes("tree/sub/c", b"c")
    store.write_bytes("tree/d", b"d")
    store.delete_folder("tree")
    store.delete_folder("tree")  # already gone: nothing
    assert not (root / "tree").exists() and store.list("ckpt") == ["b"]


def test_the_probe_writes_and_removes_its_file_and_creates_nothing(tmp_path: Path) -> None:
    RunStorage(str(tmp_path / "new" / "root")).probe(write=True)
    assert not (tmp_path / "new").exists()  # a missing root: its parent can be written
    store = RunStorage(str(tmp_path))
    store.probe(write=True)
    store.probe(write=False)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(PROBE_PREFIX)]
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageError) as err:
        RunStorage(str(tmp_path / "file" / "root")).probe(write=True)
    assert "NotADirectoryError" in err.value.reason


def test_an_unknown_protocol_is_named() -> None:
    with pytest.raises(StorageError) as err:
        RunStorage("nosuchproto://bucket/x")
    assert err.value.url == "nosuchproto://bucket/x" and "unknown protocol" in err.value.reason


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_storage_the_trainer_cannot_write_is_named(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        cfg = load_config(None, [f"run.storage={ro}"])
        assert check_storage(cfg, "rollouter") is None  # a reader only reads
        why = check_storage(cfg, "trainer")
        assert why is not None and why.startswith(f"run.storage={ro} cannot be written")
    finally:
        ro.chmod(0o700)


def test_check_storage_names_the_key_and_url(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={tmp_path}"])
    assert check_storage(cfg, "trainer") is None
    cfg = load_config(None, ["run.storage=nosuchproto://b/runs"])
    why = check_storage(cfg, "profiler")
    assert why is not None
    assert why.startswith("run.storage=nosuchproto://b/runs ") and "unknown protocol" in why


def test_the_trainer_also_checks_default_local_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    local = tmp_path / "file" / "ckpt"
    cfg = load_config(None, [f"run.output_dir={tmp_path}", f"trainer.default_local_dir={local}"])
    why = check_storage(cfg, "trainer")
    assert why is not None and why.startswith(f"trainer.default_local_dir={local} cannot be")
    assert check_storage(cfg, "rollouter") is None  # it never reads checkpoints


@pytest.mark.procs
def test_a_component_on_an_unusable_storage_exits_2_naming_it(tmp_path: Path) -> None:
    # Before Redis is contacted: the url names a port nothing listens on.
    res = subprocess.run(
        [sys.executable, "-m", "profiler_service", "redis.url=redis://127.0.0.1:1/0",
         "run.id=r1", f"run.output_dir={tmp_path}", "run.storage=nosuchproto://b/runs"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "run.storage=nosuchproto://b/runs" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_run_on_a_storage_url_keeps_its_files_there(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """run.storage=file://...: checkpoints, the events archive and the weight files of the
    storage transport are under STORAGE/RUN/, nothing of them under run.output_dir; a
    trainer killed mid-run resumes from there."""
    shared, out = tmp_path / "shared", tmp_path / "out"
    args = run_args(redis_url, run_id, out, "trainer.total_training_steps=4",
                    "trainer.save_freq=2", "rollout.weights_transport=storage",
                    f"run.storage=file://{shared}")
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=3), 180,
                   procs.watch("trainer"))
    procs.kill("trainer")
    procs.spawn("trainer2", "trainer", *args)
    assert procs.wait("trainer2", 240) == 0, procs.log("trainer2")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, 4)
    resumed = [e for e in events if isinstance(e, TrainerResumed)]
    assert resumed and resumed[0].checkpoint_step == 2 and resumed[0].weights_match is True
    root = shared / run_id
    assert (root / "checkpoints" / "step-000004.pt").is_file()
    assert any((root / "blobs").iterdir())
    assert any((root / "events").glob("archive-*.rlev"))
    assert not (out / run_id / "checkpoints").exists() and not (out / run_id / "blobs").exists()


@pytest.mark.procs
def test_rlbus_up_on_an_unusable_storage_exits_2_before_starting_anything(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    res = run_cli("up", f"run.output_dir={out}", "run.storage=nosuchproto://b/runs")
    said = res.stdout + res.stderr
    assert res.returncode == 2, said
    assert "run.storage=nosuchproto://b/runs" in said and "Traceback" not in said, said
    assert not (out / "redis").exists()  # no embedded Redis was started
