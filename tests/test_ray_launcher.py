"""`rlbus up run.launcher=ray`: the components as Ray tasks (a local Ray started by the run).

Waits are bounded by what they wait for: a local Ray's start by run.ray_connect_timeout_s
(Ray's own node start gives up after a fixed 30 s, which a loaded machine can exceed: the
launcher retries it within that bound), the rollouter's wait for the trainer's first lease by
heartbeat.timeout_s (the trainer imports torch inside a Ray worker first)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.procs import FAST

pytest.importorskip("ray", reason="the ray extra is not installed")

PATIENT = ("run.ray_connect_timeout_s=600", "heartbeat.timeout_s=600")


def _using(folder: str) -> list[str]:
    """Processes whose command line names ``folder`` (this run's Ray temp dir)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(folder in part for part in p.info["cmdline"] or ()):
            found.append(" ".join(p.info["cmdline"]))
    return found


@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_rlbus_up_on_ray_trains_and_profiles_step_1(tmp_path: Path) -> None:
    # A short temp dir of its own (Ray's socket paths must stay short): its processes are
    # recognisable among those of other Ray users of the machine.
    ray_tmp = tempfile.mkdtemp(prefix="rlray")
    try:
        res = subprocess.run(
            [sys.executable, "-m", "rlbus", "up", "run.launcher=ray", f"run.output_dir={tmp_path}",
             "run.id=ray-e2e", *FAST, *PATIENT, "trainer.total_training_steps=3",
             "global_profiler.tool=torch", "global_profiler.steps=[1]"],
            capture_output=True, text=True, timeout=1400,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": ray_tmp},
        )
        assert res.returncode == 0, res.stdout + res.stderr
        assert "Ray launcher" in res.stdout and "step    3/3" in res.stdout
        assert "Traceback" not in res.stderr, res.stderr
        manifest = json.loads((tmp_path / "profiles" / "ray-e2e" / "manifest.json").read_text())
        ok = {(s["role"], s["first_step"]) for s in manifest["sessions"] if s["status"] == "ok"}
        assert {("trainer", 1), ("rollouter", 1)} <= ok
        assert _using(ray_tmp) == []  # the local Ray it started is gone with it
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
