"""The code stays as ruff's rules want it, complexity bounds included, and as the type checker
wants it (pyproject.toml: [tool.ruff], [tool.mypy]): a function that grows past one job, or a
call that does not fit what it calls, fails CI here, not in a reviewer's head."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def mypy_cache() -> Path:
    """mypy's cache for this checkout, in the venv that runs the tests (a warm run takes
    seconds where a cold one takes a minute); one per checkout, as the cache keys modules by
    name."""
    checkout = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    return Path(sys.prefix) / "mypy-cache" / checkout


@pytest.mark.whole_tree
def test_mypy_finds_nothing() -> None:
    """mypy over the packages its config names: strict on bus, runtime and profiling, basic
    elsewhere."""
    out = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(mypy_cache())],
                         capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
