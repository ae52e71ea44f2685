"""``trainer.save_freq`` counts verl's steps, parameter versions: with
``trigger_parameter_sync_step=2`` and ``save_freq=1`` a real run checkpoints after every weight
sync (updates 2 and 4) and after its last update (5), never in between."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import FAST, run_cli

pytestmark = pytest.mark.e2e


def test_t2_save_freq_1_checkpoints_at_each_version_and_the_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    up = run_cli("up", f"run.output_dir={out}", "run.id=save-t2", *FAST,
                 "trainer.total_training_steps=5",
                 "async_training.trigger_parameter_sync_step=2", "trainer.save_freq=1",
                 timeout_s=240)
    assert up.returncode == 0, up.stdout + up.stderr
    res = run_cli("inspect", "--run", "save-t2", "--json", f"run.output_dir={out}")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    saved = [(r["step"], r["param_version"]) for r in rows if r["type"] == "CheckpointSaved"]
    assert saved == [(2, 1), (4, 2), (5, 2)]
