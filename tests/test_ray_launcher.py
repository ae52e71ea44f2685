"""`rlbus up run.launcher=ray`: the components as Ray tasks (a local Ray started by the run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import FAST, run_cli

pytest.importorskip("ray", reason="the ray extra is not installed")


@pytest.mark.e2e
def test_rlbus_up_on_ray_trains_and_profiles_step_1(tmp_path: Path) -> None:
    res = run_cli("up", "run.launcher=ray", f"run.output_dir={tmp_path}", "run.id=ray-e2e",
                  *FAST, "trainer.total_training_steps=3", "global_profiler.tool=torch",
                  "global_profiler.steps=[1]", timeout_s=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Ray launcher" in res.stdout and "step    3/3" in res.stdout
    manifest = json.loads((tmp_path / "profiles" / "ray-e2e" / "manifest.json").read_text())
    ok = {(s["role"], s["first_step"]) for s in manifest["sessions"] if s["status"] == "ok"}
    assert {("trainer", 1), ("rollouter", 1)} <= ok
