"""The Hugging Face directory of a checkpoint (``trainer.checkpoint_contents`` with
``hf_model``, verl's ``global_step_K/actor/huggingface``): it loads with
``AutoModelForCausalLM.from_pretrained``, holds the trained weights, has the tokenizer and
generation config of ``model.path``, and goes with its checkpoint under retention. On a
remote run.storage (the ``rlbustest`` protocol of tests.test_mirror) it is uploaded whole,
its completion marker last, and retention deletes the remote copy too. The model is the
chat demo's tiny Qwen2 (built here, nothing downloaded)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bus import Bus, RunKeys
from runconfig import ConfigError, load_config
from runschema.messages import CheckpointSaved, RunFinished, StepFinished
from storage.run_storage import RunStorage
from tests.procs import FAST, events_of, run_rollouter_and_trainer
from tests.test_mirror import PROTOCOL, _sitecustomize
from tests.test_verl_metrics import VERL_STEP_METRICS
from trainer.export import HFExport, hf_dir, step_folder, write_hf_dir
from trainer.mirror import HF_COMPLETE, CheckpointMirror
from trainer.resume import write_checkpoint

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tasks.chatdemo import build_model

    return build_model(tmp_path_factory.mktemp("qwen") / "model")


def _policy(path: Path) -> Any:
    from policy.hf import HFPolicy

    return HFPolicy.from_pretrained(path, device="cpu")


def _train_a_little(policy: Any) -> torch.optim.Optimizer:
    """One optimizer step, so the weights differ from model.path's."""
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    lp, _ = policy.logprobs_and_entropy(ids, torch.ones_like(ids), 3)
    (-lp.mean()).backward()
    opt.step()
    return opt


async def _on_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_exported_directory_loads_with_the_trained_weights(qwen: Path, tmp_path: Path) -> None:
    policy = _policy(qwen)
    opt = _train_a_little(policy)
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, 3, 3, _whole(policy, opt), b"state")
    export = HFExport(str(qwen))

    async def run() -> Path:
        target, warning = await export.start(_on_thread, policy, folder, 3)
        # What the worker does next (the next step's update) does not reach the export.
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(1.0)
        assert await export.wait() is None and warning is None
        return target

    trained = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    target = asyncio.run(run())
    assert target == folder / "global_step_3" / "actor" / "huggingface" == hf_dir(folder, 3)
    names = {p.name for p in target.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json"} <= names, names
    assert not [n for n in names if n.startswith(".")]
    # Every file named with its digest, which a copy is verified against (rlbus model).
    from trainer.integrity import HF_DIGESTS, verify_folder

    digests = json.loads((target / HF_DIGESTS).read_text())
    assert set(digests) == names - {HF_DIGESTS}, digests
    assert verify_folder(target) is None
    exported = _weights(target)
    original = _weights(qwen)
    assert exported.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(exported[key], value), key
    assert any(not torch.equal(exported[k], original[k]) for k in exported)
    # The model's own generation config (every EOS id) and its tokenizer, chat template too.
    gen = json.loads((target / "generation_config.json").read_text())
    assert gen == json.loads((qwen / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    orig = transformers.AutoTokenizer.from_pretrained(str(qwen), local_files_only=True)
    msgs = [{"role": "user", "content": "Reverse 1234"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        orig.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.encode("Reverse 1234") == orig.encode("Reverse 1234")
    # The whole checkpoint agrees: step-3.pt's model is the exported one.
    ckpt = torch.load(folder / "step-000003.pt", weights_only=True)
    assert all(torch.equal(ckpt["model"][f"model.{k}"], v) for k, v in exported.items())


def test_a_step_written_again_replaces_its_directory_whole(qwen: Path, tmp_path: Path) -> None:
    policy = _policy(qwen)
    target = hf_dir(tmp_path, 2)
    write_hf_dir(policy, dict(policy.model.state_dict()), str(qwen), target)
    (target / "stray").write_text("from the first write")
    _train_a_little(policy)
    write_hf_dir(policy, dict(policy.model.state_dict()), str(qwen), target)
    assert not (target / "stray").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ["huggingface"]
    state = policy.model.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in _weights(target).items())


def test_an_export_whose_checkpoint_was_deleted_leaves_nothing(qwen: Path, tmp_path: Path) -> None:
    """Retention deleted step-K.pt (and global_step_K) while the export was writing."""
    policy = _policy(qwen)
    export = HFExport(str(qwen))

    async def run() -> None:
        await export.start(_on_thread, policy, tmp_path, 1)  # no step-000001.pt there
        assert await export.wait() is None

    asyncio.run(run())
    assert not step_folder(tmp_path, 1).exists()


def test_a_failed_export_is_a_warning(tmp_path: Path, qwen: Path) -> None:
    policy = _policy(qwen)
    export = HFExport(str(tmp_path / "no-model"))  # no tokenizer there
    (tmp_path / "step-000001.pt").write_bytes(b"")

    async def run() -> Any:
        await export.start(_on_thread, policy, tmp_path, 1)
        return await export.wait()

    warning = asyncio.run(run())
    assert warning is not None and warning.code == "hf_export_failed"
    assert "step 1" in warning.message
    assert not hf_dir(tmp_path, 1).exists()
    assert not list(tmp_path.glob("global_step_1/actor/*"))  # no temporary folder left


def test_hf_model_with_the_tiny_model_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.checkpoint_contents=[model,optimizer,hf_model]"])
    assert err.value.key == "trainer.checkpoint_contents"
    assert "model.kind=hf" in err.value.message


def test_hf_model_with_an_hf_model_is_accepted(qwen: Path) -> None:
    cfg = load_config(None, ["model.kind=hf", f"model.path={qwen}",
                             "trainer.checkpoint_contents=[model,optimizer,extra,hf_model]"])
    assert "hf_model" in cfg.trainer.checkpoint_contents


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_run_exports_each_checkpoint_and_retention_deletes_them(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, qwen: Path
) -> None:
    local = tmp_path / "local"
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path / 'out'}",
            *FAST, "model.kind=hf", f"model.path={qwen}", "rollout.max_new_tokens=5",
            "trainer.total_training_steps=4", "trainer.save_freq=1",
            "trainer.max_actor_ckpt_to_keep=1", f"trainer.default_local_dir={local}",
            "trainer.checkpoint_contents=[model,optimizer,extra,hf_model]"]
    run_rollouter_and_trainer(tmp_path / "logs", args)
    events = await events_of(bus, run_keys.events)
    assert any(isinstance(e, RunFinished) for e in events)
    saved = [e for e in events if isinstance(e, CheckpointSaved)]
    assert [e.step for e in saved] == [1, 2, 3, 4]
    assert [e.hf_path for e in saved] == [str(hf_dir(local, k)) for k in (1, 2, 3, 4)]
    assert not any(getattr(e, "code", "") == "hf_export_failed" for e in events)
    # Checkpoints went to trainer.default_local_dir; nothing to the run folder.
    assert not (tmp_path / "out" / run_id / "checkpoints").exists()
    kept = sorted(int(p.stem.split("-")[1]) for p in local.glob("step-*.pt"))
    assert kept and 1 not in kept and 4 in kept  # retention dropped the oldest
    # Each kept checkpoint has its HF directory, each dropped one lost it.
    assert sorted(int(p.name.split("_")[2]) for p in local.glob("global_step_*")) == kept
    last = hf_dir(local, 4)
    exported = _weights(last)
    ckpt = torch.load(local / "step-000004.pt", weights_only=True)
    for key, value in exported.items():
        assert torch.equal(ckpt["model"][f"model.{key}"], value), key
    original = _weights(qwen)
    assert any(not torch.equal(exported[k], original[k]) for k in exported)
    finished = [e for e in events if isinstance(e, StepFinished)]
    assert [e.step for e in finished] == [1, 2, 3, 4]
    for e in finished:  # verl's metrics, in every step
        m = e.metrics
        assert m["timing_s/gen"] > 0 and m["timing_s/reward"] >= 0
        assert m["timing_s/update_actor"] == m["trainer/update_s"] > 0
        assert 1 <= m["response_length/mean"] <= m["response_length/max"] <= 5
        assert 0 <= m["response_length/clip_ratio"] <= 1 and m["prompt_length/mean"] >= 1
        assert [k for k in VERL_STEP_METRICS if k not in m] == [], e.step
        assert m["training/global_step"] == e.step
        assert m["perf/total_num_tokens"] > 0 and m["perf/throughput"] > 0
        assert not {"reward/mean", "reward/max", "response/length_mean"} & m.keys()
        assert m["critic/returns/mean"] == m["critic/advantages/mean"]
        assert m["fully_async/count/current_param_version"] == e.param_version


class _Recorded(RunStorage):
    """The test storage, recording the names written to it in order."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.written: list[str] = []

    def upload(self, local: Any, name: str) -> None:
        super().upload(local, name)
        self.written.append(name)

    def write_bytes(self, name: str, data: bytes) -> None:
        super().write_bytes(name, data)
        self.written.append(name)


def _export(export: HFExport, policy: Any, folder: Path, step: int) -> Any:
    async def run() -> Any:
        await export.start(_on_thread, policy, folder, step)
        return await export.wait()

    return asyncio.run(run())


def test_on_a_remote_storage_the_directory_is_uploaded_whole_marker_last(
    qwen: Path, tmp_path: Path
) -> None:
    policy = _policy(qwen)
    opt = _train_a_little(policy)
    folder, remote = tmp_path / "ckpt", tmp_path / "remote"
    storage = _Recorded(f"{PROTOCOL}://{remote}")
    mirror = CheckpointMirror(storage, folder, "r1/checkpoints")
    write_checkpoint(folder, 3, 3, _whole(policy, opt), b"state")
    assert _export(HFExport(str(qwen), mirror), policy, folder, 3) is None
    there = remote / "r1" / "checkpoints" / "global_step_3" / "actor" / "huggingface"
    local = {p.name for p in hf_dir(folder, 3).iterdir()}
    assert {p.name for p in there.iterdir()} == local | {HF_COMPLETE}
    assert {"config.json", "model.safetensors"} <= local
    prefix = "r1/checkpoints/global_step_3/actor/huggingface/"
    assert storage.written[-1] == prefix + HF_COMPLETE  # after every file
    assert sorted(storage.written[:-1]) == sorted(prefix + n for n in local)
    marker = json.loads((there / HF_COMPLETE).read_text())
    assert marker["step"] == 3
    assert marker["files"] == {n: (there / n).stat().st_size for n in local}
    # Another node fetches it and loads it: the trained weights.
    fetched = tmp_path / "fetched"
    other = CheckpointMirror(RunStorage(f"{PROTOCOL}://{remote}"), tmp_path / "b",
                             "r1/checkpoints")
    assert other.download_hf(3, fetched)
    assert other.download_hf(5, tmp_path / "none") is False  # none there
    trained = dict(policy.model.state_dict())
    loaded = _weights(fetched)
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.items())
    # Retention's delete of checkpoint 3 removes the remote directory (marker first).
    other.delete([3])
    assert not (remote / "r1" / "checkpoints" / "global_step_3").exists()
    assert other.download_hf(3, tmp_path / "gone") is False


def test_a_remote_directory_written_again_loses_the_old_files(qwen: Path, tmp_path: Path) -> None:
    policy = _policy(qwen)
    storage = RunStorage(f"{PROTOCOL}://{tmp_path / 'remote'}")
    mirror = CheckpointMirror(storage, tmp_path / "ckpt", "r1/checkpoints")
    target = hf_dir(tmp_path / "ckpt", 2)
    write_hf_dir(policy, dict(policy.model.state_dict()), str(qwen), target)
    (target / "stray").write_text("from the first export")
    mirror.upload_hf(target, 2)
    write_hf_dir(policy, dict(policy.model.state_dict()), str(qwen), target)
    mirror.upload_hf(target, 2)
    prefix = "r1/checkpoints/global_step_2/actor/huggingface"
    assert "stray" not in storage.list(prefix) and HF_COMPLETE in storage.list(prefix)
    assert "stray" not in json.loads(storage.read_bytes(f"{prefix}/{HF_COMPLETE}"))["files"]


def test_a_remote_export_of_a_dropped_checkpoint_leaves_nothing(qwen: Path, tmp_path: Path) -> None:
    """Retention deleted step-K.pt while the export was writing: nothing is uploaded."""
    policy = _policy(qwen)
    remote = tmp_path / "remote"
    mirror = CheckpointMirror(RunStorage(f"{PROTOCOL}://{remote}"), tmp_path, "r1/checkpoints")
    assert _export(HFExport(str(qwen), mirror), policy, tmp_path, 1) is None  # no .pt
    assert not (remote / "r1" / "checkpoints" / "global_step_1").exists()


def test_a_storage_that_refuses_the_upload_is_a_warning(qwen: Path, tmp_path: Path) -> None:
    policy = _policy(qwen)
    blocker = tmp_path / "remote"
    blocker.write_text("a file where the storage's folder should be")
    mirror = CheckpointMirror(RunStorage(f"{PROTOCOL}://{blocker}"), tmp_path / "ckpt",
                              "r1/checkpoints")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step-000001.pt").write_bytes(b"")
    warning = _export(HFExport(str(qwen), mirror), policy, tmp_path / "ckpt", 1)
    assert warning is not None and warning.code == "hf_export_failed"
    assert "written, but not copied to" in warning.message and "step 1" in warning.message
    assert (hf_dir(tmp_path / "ckpt", 1) / "config.json").is_file()  # the local copy is whole


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_run_on_a_remote_storage_mirrors_its_hf_directories(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, qwen: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """run.storage=rlbustest://...: each kept checkpoint's HF directory is in the storage,
    complete; retention deleted the dropped ones there as here."""
    _sitecustomize(tmp_path, monkeypatch)
    out, remote = tmp_path / "out", tmp_path / "remote"
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={out}",
            *FAST, "model.kind=hf", f"model.path={qwen}", "rollout.max_new_tokens=5",
            "trainer.total_training_steps=3", "trainer.save_freq=1",
            "trainer.max_actor_ckpt_to_keep=1", "run.retention=checkpoint",
            f"run.storage={PROTOCOL}://{remote}",
            "trainer.checkpoint_contents=[model,optimizer,extra,hf_model]"]
    run_rollouter_and_trainer(tmp_path / "logs", args)
    events = await events_of(bus, run_keys.events)
    assert not any(getattr(e, "code", "") == "hf_export_failed" for e in events)
    local = out / run_id / "checkpoints"
    kept = sorted(p.name for p in local.glob("global_step_*"))
    mirrored = remote / run_id / "checkpoints"
    assert "global_step_3" in kept and "global_step_1" not in kept, kept
    assert sorted(p.name for p in mirrored.glob("global_step_*")) == kept
    storage = CheckpointMirror(RunStorage(f"{PROTOCOL}://{remote}"), tmp_path / "b",
                               f"{run_id}/checkpoints")
    assert storage.download_hf(3, tmp_path / "fetched")
    ckpt = torch.load(local / "step-000003.pt", weights_only=True)
    for key, value in _weights(tmp_path / "fetched").items():
        assert torch.equal(ckpt["model"][f"model.{key}"], value), key


def _whole(policy: Any, opt: Any) -> Any:
    """A one-rank checkpoint's payload (trainer.learner.Learner.checkpoint_payload)."""
    return lambda _path: {"model": policy.state_dict(), "optimizer": opt.state_dict()}
