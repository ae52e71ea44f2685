"""``rlbus model``: a run's exported Hugging Face directory copied to a folder, from this
node's checkpoint folder or from a remote run.storage (the ``rlbustest`` protocol of
tests/test_mirror.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bus import Bus, RunKeys
from rlbus.model import ModelNotFound, exported_steps, fetch_model
from runconfig import config_to_dict, load_config
from runschema.messages import RunStarted
from storage.run_storage import RunStorage
from tests.procs import run_cli
from tests.test_mirror import PROTOCOL
from trainer.export import hf_dir
from trainer.mirror import HF_COMPLETE, CheckpointMirror

RUN = "r1"


def _export(folder: Path, step: int) -> Path:
    """A checkpoint of ``step`` with its Hugging Face directory, as the trainer leaves it."""
    target = hf_dir(folder, step)
    target.mkdir(parents=True)
    (target / "config.json").write_text(f'{{"step": {step}}}')
    (target / "model.safetensors").write_bytes(bytes([step]) * 100)
    (folder / f"step-{step:06d}.pt").write_bytes(b"")
    return target


def test_the_newest_local_export_or_the_asked_step_is_copied(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={tmp_path / 'out'}"])
    folder = tmp_path / "out" / RUN / "checkpoints"
    _export(folder, 2)
    _export(folder, 4)
    (folder / "global_step_6").mkdir()  # a checkpoint whose export is not in place yet
    assert exported_steps(cfg, RUN) == {2: "local", 4: "local"}
    assert fetch_model(cfg, RUN, None, tmp_path / "m4")[0] == 4
    assert (tmp_path / "m4" / "model.safetensors").read_bytes() == bytes([4]) * 100
    assert fetch_model(cfg, RUN, 2, tmp_path / "m2")[0] == 2
    assert (tmp_path / "m2" / "config.json").read_text() == '{"step": 2}'
    with pytest.raises(ModelNotFound, match=r"step 6 .* exported steps: 2, 4"):
        fetch_model(cfg, RUN, 6, tmp_path / "m6")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        fetch_model(cfg, RUN, 2, tmp_path / "m4")  # never over another model


def test_a_copy_is_verified_against_the_digests_the_export_wrote(tmp_path: Path) -> None:
    from trainer.integrity import HF_DIGESTS, write_folder_digests

    cfg = load_config(None, [f"run.output_dir={tmp_path / 'out'}"])
    folder = tmp_path / "out" / RUN / "checkpoints"
    for step in (2, 4):
        write_folder_digests(_export(folder, step))
    assert (hf_dir(folder, 4) / HF_DIGESTS).is_file()
    assert fetch_model(cfg, RUN, None, tmp_path / "good")[0] == 4
    weights = hf_dir(folder, 4) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[50] ^= 0xFF  # one flipped byte, same size
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelNotFound) as err:
        fetch_model(cfg, RUN, None, tmp_path / "bad")
    assert str(err.value) == (
        f"the Hugging Face directory of step 4 at {hf_dir(folder, 4)} is not as the trainer "
        f"wrote it: {weights} does not hash to the sha256 recorded when it was written "
        "(corrupt); other exported steps: 2 (--step K)")
    assert not (tmp_path / "bad").exists()  # no copy of a corrupt model is left
    (hf_dir(folder, 2) / "config.json").unlink()
    with pytest.raises(ModelNotFound, match=r"config.json is missing"):
        fetch_model(cfg, RUN, 2, tmp_path / "bad")
    # Exported before digests were written: copied as it is.
    (hf_dir(folder, 4) / HF_DIGESTS).unlink()
    assert fetch_model(cfg, RUN, 4, tmp_path / "old")[0] == 4


def test_an_export_only_in_the_storage_is_fetched_whole_only(tmp_path: Path) -> None:
    """Another node wrote it: this node's folder is empty. An upload without its marker (cut
    short) does not count."""
    remote, written = tmp_path / "remote", tmp_path / "nodeA"
    mirror = CheckpointMirror(RunStorage(f"{PROTOCOL}://{remote}"), written,
                              f"{RUN}/checkpoints")
    for step in (3, 5):
        target = _export(written, step)
        mirror.storage.upload(written / f"step-{step:06d}.pt",
                              f"{RUN}/checkpoints/step-{step:06d}.pt")
        mirror.upload_hf(target, step)
    mirror.storage.delete(f"{RUN}/checkpoints/global_step_5/actor/huggingface/{HF_COMPLETE}")
    cfg = load_config(None, [f"run.output_dir={tmp_path / 'nodeB'}",
                             f"run.storage={PROTOCOL}://{remote}"])
    assert exported_steps(cfg, RUN) == {3: "storage"}
    step, source = fetch_model(cfg, RUN, None, tmp_path / "m")
    assert step == 3 and source == mirror.hf_where(3)
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == bytes([3]) * 100
    assert not (tmp_path / "m" / HF_COMPLETE).exists()


@pytest.mark.procs
def test_no_export_is_exit_2_in_one_line_naming_where_it_looked(tmp_path: Path) -> None:
    r = run_cli("model", "--run", RUN, "--out", str(tmp_path / "m"),
                f"run.output_dir={tmp_path / 'out'}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"rlbus model: error: run {RUN} has no exported Hugging Face directory in "
        f"{tmp_path / 'out' / RUN / 'checkpoints'} (the trainer exports one per kept "
        "checkpoint when trainer.checkpoint_contents has hf_model)"]
    folder = tmp_path / "out" / RUN / "checkpoints"
    _export(folder, 7)
    r = run_cli("model", "--run", RUN, "--out", str(tmp_path / "m"),
                f"run.output_dir={tmp_path / 'out'}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"step 7: {hf_dir(folder, 7)} -> {tmp_path / 'm'}"


@pytest.mark.procs
def test_the_checkpoint_folder_a_run_recorded_is_where_it_looks(tmp_path: Path) -> None:
    # A verl launch line sets trainer.default_local_dir; `rlbus model` is then given only the
    # run and its output folder: the folder comes from the config rlbus up recorded.
    ckpts, out = tmp_path / "ckpts" / "exp1", tmp_path / "out"
    _export(ckpts, 4)
    (out / RUN).mkdir(parents=True)
    recorded = config_to_dict(load_config(None, [f"trainer.default_local_dir={ckpts}",
                                                 f"run.id={RUN}"]))
    (out / RUN / "config.yaml").write_text(yaml.safe_dump(recorded))
    r = run_cli("model", "--run", RUN, "--out", str(tmp_path / "m"), f"run.output_dir={out}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"step 4: {hf_dir(ckpts, 4)} -> {tmp_path / 'm'}"
    assert f"trainer.default_local_dir={ckpts} (recorded by run {RUN})" in r.stderr


@pytest.mark.procs
@pytest.mark.asyncio
async def test_the_checkpoint_folder_in_the_run_s_log_is_where_it_looks(
    tmp_path: Path, bus: Bus, redis_url: str, run_id: str
) -> None:
    # Components started one by one write no config.yaml: the log's RunStarted says it.
    ckpts = tmp_path / "elsewhere"
    _export(ckpts, 2)
    recorded = config_to_dict(load_config(None, [f"trainer.default_local_dir={ckpts}",
                                                 f"run.id={run_id}"]))
    await bus.publish(RunKeys(run_id).events, RunStarted(run_id=run_id, config=recorded))
    r = run_cli("model", "--run", run_id, "--out", str(tmp_path / "m"),
                f"redis.url={redis_url}", f"run.output_dir={tmp_path / 'out'}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"step 2: {hf_dir(ckpts, 2)} -> {tmp_path / 'm'}"
