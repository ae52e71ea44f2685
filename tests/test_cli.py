"""The `rlbus` command line: sub-commands start, stop and refuse bad input as documented."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import redis

from tests.procs import run_cli


def test_rlbus_redis_starts_prints_url_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbus", "redis", f"run.output_dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()  # the URL is the first line it prints
        assert url.startswith("redis://127.0.0.1:"), url
        client = redis.Redis.from_url(url, socket_timeout=10)
        assert client.ping()
        client.set("k", "v")
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert (tmp_path / "redis").is_dir()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # drains and closes the pipes


def test_help_and_unknown_command() -> None:
    ok = run_cli("--help")
    assert ok.returncode == 0 and "rlbus up" not in ok.stderr and "inspect" in ok.stdout
    bad = run_cli("frobnicate")
    assert bad.returncode == 2 and "unknown command" in bad.stderr


def test_profile_bad_spec_and_roles_exit_2() -> None:
    res = run_cli("profile", "--run", "r1", "--steps", "0-x", "redis.url=redis://127.0.0.1:1/0")
    assert res.returncode == 2 and "--steps" in res.stderr, res.stderr
    res = run_cli("profile", "--run", "r1", "--steps", "3", "--roles", "gpu",
                  "redis.url=redis://127.0.0.1:1/0")
    assert res.returncode == 2 and "--roles" in res.stderr, res.stderr


def test_inspect_unknown_run_says_so(tmp_path: Path) -> None:
    res = run_cli("inspect", "--run", "nothing-here", f"run.output_dir={tmp_path}")
    assert res.returncode == 1 and "no events" in res.stderr
