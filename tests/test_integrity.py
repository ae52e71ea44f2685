"""Checkpoint integrity without processes (issue 36 item 1): every file of a checkpoint has
the digest its CheckpointSaved records, the fold keeps them for the checkpoints a resume may
load, a flipped, truncated or missing file is found before anything loads it, a corrupt
snapshot is refused even when it decodes, and weights holding a NaN are never published."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from runschema.messages import (
    CheckpointSaved,
    FileDigest,
    RunStarted,
    StepFinished,
    TicketsIssued,
)
from trainer.integrity import HashingWriter, file_digest, folder_digests, verify_files
from trainer.learner import NonFiniteWeights, check_finite
from trainer.ledger import ticket_id
from trainer.resume import (
    ResumeFailed,
    Snapshot,
    pick_checkpoint,
    snapshot_fault,
    write_checkpoint,
)
from trainer.state import TrainerState, fold


def _payload(_: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    return {"model": model.state_dict(), "optimizer": {}}


def _flip(path: Path, count: int = 128) -> None:
    """Flip ``count`` bytes in the middle of ``path`` (its size unchanged)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, min(mid + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_digest_of_a_streamed_write_is_the_files(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    with open(path, "wb") as fh:
        writer = HashingWriter(fh)
        writer.write(b"abc")
        writer.write(memoryview(b"defgh"))
        writer.write(bytearray(1000))
        writer.flush()
    assert writer.digest() == file_digest(path)
    assert writer.digest().sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_write_checkpoint_records_the_digest_of_each_file(tmp_path: Path) -> None:
    path, files = write_checkpoint(tmp_path, 6, 3, _payload, b"snapshot bytes")
    assert path == tmp_path / "step-000006.pt"
    assert set(files) == {"step-000006.pt", "step-000006.state"}
    assert files["step-000006.pt"] == file_digest(path)
    assert files["step-000006.state"] == file_digest(path.with_suffix(".state"))
    torch.load(path, weights_only=True)  # what went through the hash is a whole checkpoint


def test_shard_digests_are_named_under_their_folder(tmp_path: Path) -> None:
    shards = tmp_path / "step-000004.dcp"
    (shards / "sub").mkdir(parents=True)
    (shards / "__0_0.distcp").write_bytes(b"x" * 10)
    (shards / "sub" / ".metadata").write_bytes(b"meta")
    found = folder_digests(str(shards), "step-000004.dcp")
    assert found == {"step-000004.dcp/__0_0.distcp": file_digest(shards / "__0_0.distcp"),
                     "step-000004.dcp/sub/.metadata": file_digest(shards / "sub/.metadata")}
    remote = folder_digests(f"file://{shards}", "step-000004.dcp")
    assert remote == found  # file:// is local: hashed


@pytest.mark.parametrize("harm", ["flip", "truncate", "delete", "none"])
def test_a_harmed_checkpoint_file_is_found_and_named(tmp_path: Path, harm: str) -> None:
    path, files = write_checkpoint(tmp_path, 6, 3, _payload, b"snap")
    if harm == "flip":
        _flip(path)
    elif harm == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif harm == "delete":
        path.unlink()
    why = verify_files(files, {path.name: str(path), path.with_suffix(".state").name:
                               str(path.with_suffix(".state"))})
    expected = {"flip": "corrupt", "truncate": "truncated", "delete": "missing", "none": None}
    if expected[harm] is None:
        assert why is None
    else:
        assert why is not None and str(path) in why and expected[harm] in why


def test_a_shard_missing_from_its_folder_is_named(tmp_path: Path) -> None:
    files = {"step-000004.pt": FileDigest(size=0, sha256=hashlib.sha256().hexdigest()),
             "step-000004.dcp/__1_0.distcp": FileDigest(size=3)}
    (tmp_path / "step-000004.pt").write_bytes(b"")
    (tmp_path / "step-000004.dcp").mkdir()
    why = verify_files(files, {"step-000004.pt": str(tmp_path / "step-000004.pt"),
                               "step-000004.dcp": str(tmp_path / "step-000004.dcp")})
    assert why is not None and "__1_0.distcp is missing" in why


def _step(k: int) -> list[Any]:
    """Step ``k``'s ticket issued and its StepFinished (the ledger refuses a step that
    trains no ticket)."""
    tid = ticket_id(k)
    return [TicketsIssued(ticket_ids=[tid], n=1, param_version=0),
            StepFinished(step=k, sample_ids=[f"{tid}/0"], metrics={}, duration_s=0.1,
                         entry_ids=[f"{k}-0"])]


def _saved(k: int, files: dict[str, FileDigest]) -> CheckpointSaved:
    return CheckpointSaved(step=k, path=f"c/step-{k:06d}.pt", param_version=k, files=files)


def _log(files: dict[str, FileDigest]) -> list[Any]:
    steps = _step(1)
    return [RunStarted(run_id="r", config={"trainer": {"total_training_steps": 9,
                                                       "nnodes": 1, "n_gpus_per_node": 2}}),
            steps[0], _saved(1, files), steps[1]]


def test_the_fold_keeps_the_digests_of_the_checkpoints_it_keeps() -> None:
    files = {"step-000001.pt": FileDigest(size=5, sha256="ab")}
    state = fold(_log(files))
    assert state.ranks == 2
    assert state.files_of("c/step-000001.pt") == files
    assert state.files_of("c/other.pt") == {}
    # Old checkpoints leave the state with their digests: bounded over any run.
    log = _log(files)
    for k in range(2, 9):
        issued, finished = _step(k)
        log += [issued, _saved(k, {f"step-{k:06d}.pt": FileDigest(size=k)}), finished]
    state = fold(log)
    assert state.last_step == 8
    assert sorted(state.checkpoint_files) == ["c/step-000007.pt", "c/step-000008.pt"]
    # The snapshot round trip keeps them (a resume folds from one).
    snap = Snapshot(state=state, position="1-0")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=Snapshot)
    assert back.state.checkpoint_files == state.checkpoint_files


def test_pick_checkpoint_passes_over_a_corrupt_one_with_its_reason() -> None:
    issued, finished = _step(2)
    state = fold([*_log({}), issued, _saved(2, {}), finished])
    faults = {"c/step-000002.pt": "c/step-000002.pt does not hash ... (corrupt)"}
    step, path, skipped = pick_checkpoint(state, faults.get)
    assert (step, path, skipped) == (1, "c/step-000001.pt", [faults["c/step-000002.pt"]])
    with pytest.raises(ResumeFailed, match=r"step-000002.*corrupt.*; step-000001 broken"):
        pick_checkpoint(state, {**faults, "c/step-000001.pt": "step-000001 broken"}.get)


def test_a_snapshot_that_decodes_but_was_changed_is_refused(tmp_path: Path) -> None:
    state_file = tmp_path / "step-000001.state"
    data = msgspec.msgpack.encode(Snapshot(state=TrainerState(last_step=1), position="1-0"))
    state_file.write_bytes(data)
    recorded = {"step-000001.state": file_digest(state_file)}
    state = fold(_log(recorded))
    assert snapshot_fault(state, state_file, file_digest(state_file)) is None
    # Another state that decodes just as well: last_step 2 instead of 1.
    other = msgspec.msgpack.encode(Snapshot(state=TrainerState(last_step=2), position="1-0"))
    state_file.write_bytes(other)
    why = snapshot_fault(state, state_file, file_digest(state_file))
    assert why is not None and "step-000001.state" in why and "corrupt" in why
    # A log written before digests were: nothing to check against.
    assert snapshot_fault(fold(_log({})), state_file, file_digest(state_file)) is None


def test_weights_with_a_nan_are_never_published() -> None:
    ok = {"a.weight": torch.ones(3), "steps": torch.tensor([1, 2])}
    check_finite(ok, 4)
    bad = {**ok, "b.bias": torch.tensor([0.0, float("nan"), float("inf")])}
    with pytest.raises(NonFiniteWeights, match=r"weights v4 hold 2 NaN or infinite values "
                                               r"in b\.bias"):
        check_finite(bad, 4)


def test_a_changed_rank_count_is_judged_by_the_measured_gap_not_the_hash() -> None:
    from trainer.replay import TOLERANCE
    from trainer.resume import mismatch_verdict

    what = "the resumed model does not hash to weights version 5"
    # The same ranks: a mismatch, stopped or warned as the key says.
    assert mismatch_verdict(what, None, None, "fail")[:2] == (True, "resume_weights_mismatch")
    assert mismatch_verdict(what, None, None, "warn") == (False, "resume_weights_mismatch", what)
    # Changed ranks: within the tolerance goes on, said with the figure.
    stop, code, line = mismatch_verdict(what, (1, 2), TOLERANCE / 10, "fail")
    assert (stop, code) == (False, "resume_weights_tolerance")
    assert "changed from 1 to 2" in line and "0.5% of the run's move" in line
    # Past it: a mismatch like any other.
    stop, code, line = mismatch_verdict(what, (1, 2), 0.9, "fail")
    assert stop and "90% of the run's move" in line and "past the 5% tolerance" in line
    assert mismatch_verdict(what, (1, 2), 0.9, "warn")[0] is False
    # Not measurable (the broadcast transport keeps no copy): said, never stopped.
    stop, code, line = mismatch_verdict(what, (2, 1), None, "fail")
    assert not stop and "not measured" in line
