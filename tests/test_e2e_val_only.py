"""verl's ``trainer.val_only`` on real processes (``rlbus up``, embedded Redis, the chat
demo's tiny model, parquet data and reward file): a fresh run validates the initial model
once and finishes without a step; a run that trained is not ended by a validation (exit 2
naming the fork that validates it instead), and that fork validates the parent's model after
its step, then finishes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import FAST, run_cli

pytest.importorskip("tasks.verl_data", reason="the verl data loader is not in this tree")

pytestmark = pytest.mark.e2e

UP_S = 280


def _demo_args(tmp_path: Path) -> list[str]:
    from tasks.chatdemo import build_demo

    demo = build_demo(tmp_path / "demo", n_train=32, n_val=8)
    return [f"run.output_dir={tmp_path / 'out'}", *FAST, "model.kind=hf",
            f"model.path={demo / 'model'}", f"data.train_files={demo / 'train.parquet'}",
            f"data.val_files={demo / 'val.parquet'}",
            f"custom_reward_function.path={demo / 'reward.py'}", "rollout.max_new_tokens=6",
            "trainer.logger=[]", "trainer.total_training_steps=2"]


def _events(args: list[str], run: str) -> list[dict]:
    res = run_cli("inspect", "--run", run, "--json", *args[:1])
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


def _kinds(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def test_val_only_validates_the_initial_model_and_trains_nothing(tmp_path: Path) -> None:
    args = _demo_args(tmp_path)
    up = run_cli("up", *args, "run.id=vo", "trainer.val_only=True", timeout_s=UP_S)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "validation only (trainer.val_only), nothing trained" in up.stdout
    events = _events(args, "vo")
    answers = _kinds(events, "ValidationFinished")
    assert [(a["request_id"], a["version"], a["step"]) for a in answers] == [("val-v0", 0, 0)]
    assert not answers[0]["error"]
    from tasks.chatdemo import DATA_SOURCE

    assert f"val-core/{DATA_SOURCE}/reward/mean@1" in answers[0]["metrics"]
    assert _kinds(events, "StepStarted") == [] and _kinds(events, "StepFinished") == []
    [finished] = _kinds(events, "RunFinished")
    assert (finished["steps"], finished["validation_only"]) == (0, True)
    assert events.index(finished) > events.index(answers[0])
    # Again: the run is finished, nothing is asked twice.
    again = run_cli("up", *args, "run.id=vo", "trainer.val_only=True", timeout_s=UP_S)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already finished, validating the weights after step 0" in again.stdout
    assert len(_kinds(_events(args, "vo"), "ValidationFinished")) == 1


def test_a_trained_run_is_validated_through_a_fork_never_ended(tmp_path: Path) -> None:
    args = _demo_args(tmp_path)
    up = run_cli("up", *args, "run.id=tr", "trainer.save_freq=2", timeout_s=UP_S)
    assert up.returncode == 0, up.stdout + up.stderr
    refused = run_cli("up", *args, "run.id=tr", "trainer.val_only=True", timeout_s=UP_S)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert ("rlbus fork --run tr --at 2 --new-run NEW trainer.val_only=True"
            in refused.stdout + refused.stderr)
    assert len(_kinds(_events(args, "tr"), "RunFinished")) == 1  # the training run's own

    fork = run_cli("fork", "--run", "tr", "--at", "2", "--new-run", "tr-val",
                   "trainer.val_only=True", *args[:1], timeout_s=UP_S)
    assert fork.returncode == 0, fork.stdout + fork.stderr
    up = run_cli("up", *args, "run.id=tr-val", timeout_s=UP_S)
    assert up.returncode == 0, up.stdout + up.stderr
    events = _events(args, "tr-val")
    answers = _kinds(events, "ValidationFinished")
    assert [(a["request_id"], a["version"], a["step"]) for a in answers] == [("val-v2", 2, 2)]
    assert [e["step"] for e in _kinds(events, "StepFinished")] == [1, 2]  # the parent's
    [finished] = _kinds(events, "RunFinished")
    assert (finished["steps"], finished["validation_only"]) == (2, True)
