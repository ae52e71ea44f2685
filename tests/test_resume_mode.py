"""``trainer.default_local_dir`` and ``trainer.resume_mode`` through the real ``rlbus up``:
the same launch line finds its run again (auto: a finished run says so, a longer one is
continued from its checkpoint there) or starts a new one (disable)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runconfig import load_config
from runconfig.paths import RUN_MARKER, checkpoint_dir
from tests.procs import FAST, run_cli

LINE = (*FAST, "trainer.logger=[console]", "trainer.total_training_steps=2",
        "heartbeat.timeout_s=60")


def _line(out: Path, local: Path, *more: str) -> list[str]:
    return ["up", f"run.output_dir={out}", f"trainer.default_local_dir={local}", *LINE, *more]


def _marked(local: Path) -> str:
    return json.loads((local / RUN_MARKER).read_text())["run_id"]


def _events(out: Path, run_id: str) -> list[dict[str, Any]]:
    res = run_cli("inspect", "--run", run_id, "--json", f"run.output_dir={out}")
    assert res.returncode == 0, res.stdout + res.stderr
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def _runs(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if (p / "config.yaml").is_file())


def _up(*args: str) -> str:
    res = run_cli(*args, timeout_s=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_the_checkpoint_folder_is_default_local_dir_when_set(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={tmp_path}"])
    assert checkpoint_dir(cfg, "r1") == tmp_path / "r1" / "checkpoints"
    cfg = load_config(None, [f"trainer.default_local_dir={tmp_path / 'ckpt'}"])
    assert checkpoint_dir(cfg, "r1") == tmp_path / "ckpt"


@pytest.mark.e2e
def test_auto_the_same_line_finds_its_run(tmp_path: Path) -> None:
    out, local = tmp_path / "out", tmp_path / "local"
    first = _up(*_line(out, local))
    run_id = _marked(local)
    assert _runs(out) == [run_id]
    assert (local / "step-000002.pt").is_file()
    assert f"checkpoints  {local}" in first
    # The same line again: the run is found and is finished.
    again = _up(*_line(out, local))
    assert f"run {run_id} already finished after 2 steps" in again, again
    assert _runs(out) == [run_id]
    # The same line with more steps: the run continues from its checkpoint in local.
    more = _up(*_line(out, local, "trainer.total_training_steps=3"))
    assert f"resuming run {run_id} after step 2" in more, more
    assert _runs(out) == [run_id] and _marked(local) == run_id
    events = _events(out, run_id)
    resumed = [e for e in events if e["type"] == "TrainerResumed"]
    assert resumed and resumed[-1]["checkpoint_step"] == 2 and resumed[-1]["step"] == 2
    assert [e["step"] for e in events if e["type"] == "StepFinished"] == [1, 2, 3]
    assert (local / "step-000003.pt").is_file()


@pytest.mark.e2e
def test_disable_starts_a_new_run_that_loads_nothing_old(tmp_path: Path) -> None:
    out, local = tmp_path / "out", tmp_path / "local"
    _up(*_line(out, local))
    old = _marked(local)
    text = _up(*_line(out, local, "trainer.resume_mode=disable"))
    new = _marked(local)
    assert new != old and _runs(out) == sorted([old, new]), text
    assert "already finished" not in text
    events = _events(out, new)
    started = [e for e in events if e["type"] == "RunStarted"]
    assert len(started) == 1 and started[0]["resumed"] is False
    assert not [e for e in events if e["type"] == "TrainerResumed"]
    assert [e["step"] for e in events if e["type"] == "StepFinished"] == [1, 2]
    # Its checkpoints went to the same folder; the marker names the new run.
    saved = [e for e in events if e["type"] == "CheckpointSaved"]
    assert saved and all(Path(e["path"]).parent == local for e in saved)


@pytest.mark.procs
def test_a_marker_that_names_no_run_exits_2_naming_the_file(tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    (local / RUN_MARKER).write_text("not json")
    res = run_cli(*_line(tmp_path / "out", local))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "'trainer.default_local_dir'" in res.stderr and RUN_MARKER in res.stderr
    assert not (tmp_path / "out").exists()
