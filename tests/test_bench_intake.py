"""bench/trainer_intake.py's fake rollouter still satisfies the trainer: a two-step smoke run
whose every sample is trained and none refused (the bench's figures are not checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.procs
def test_trainer_intake_smoke() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "trainer_intake.py"), "--sizes", "2.5",
         "--steps", "2", "--warmup", "1", "--prompts", "4", "--n", "2",
         "--require-batches", "1", "--timeout", "120", "--json"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    (size,) = summary["sizes"]
    trainer = size["trainer"]
    assert trainer["samples"] == 2 * 4 * 2  # steps x prompts x n: every answer trained
    assert trainer["refused"] == 0
    assert 2400 < size["sample_bytes"] < 2800
