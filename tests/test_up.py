"""`rlbus up` as a newcomer meets it: what it refuses before anything starts (an unreachable
Ray address, a step past the run, an output folder whose Redis is live), and a continued run
that keeps the config its log recorded (overrides on top, said; no embedded URL saved) and
does not report the traces written before it as missed."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from rlbus.redis_binary import free_port
from rlbus.redis_server import EmbeddedRedis
from rlbus.runlog import config_changes, recorded_config
from runconfig import config_to_dict, load_config
from tests.procs import FAST, run_cli
from tests.test_supervise import LONG, Up, _gone


@pytest.mark.procs
def test_unreachable_ray_address_is_one_line_and_creates_nothing(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    out = tmp_path / "out"
    res = run_cli("up", "run.launcher=ray", f"run.ray_address=127.0.0.1:{port}",
                  "run.ray_connect_timeout_s=1", f"run.output_dir={out}")
    assert res.returncode == 1, res.stdout + res.stderr
    errors = res.stderr.strip().splitlines()
    assert len(errors) == 1, res.stderr
    assert f"127.0.0.1:{port}" in errors[0] and "run.ray_connect_timeout_s" in errors[0]
    assert not out.exists()  # no embedded Redis, no run folder


@pytest.mark.procs
def test_a_ray_address_where_redis_listens_is_one_line_and_creates_nothing(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    # Ray's default port is Redis's: ray.init on a Redis server waits for ever. The probe
    # asks as a gRPC client and names what answered, at once (the timeout is not waited out).
    out = tmp_path / "out"
    res = run_cli("up", "run.launcher=ray", f"run.ray_address=127.0.0.1:{redis_server.port}",
                  "run.ray_connect_timeout_s=600", f"run.output_dir={out}", timeout_s=120)
    assert res.returncode == 1, res.stdout + res.stderr
    errors = res.stderr.strip().splitlines()
    assert len(errors) == 1, res.stderr
    assert f"127.0.0.1:{redis_server.port}" in errors[0] and "not a Ray cluster" in errors[0]
    assert "Redis" in errors[0]
    assert not out.exists()


@pytest.mark.procs
def test_malformed_ray_address_exits_2_naming_the_key(tmp_path: Path) -> None:
    res = run_cli("up", "run.launcher=ray", "run.ray_address=nohost",
                  f"run.output_dir={tmp_path / 'out'}")
    assert res.returncode == 2 and "'run.ray_address'" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.procs
def test_a_profiled_step_past_the_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    res = run_cli("up", f"run.output_dir={tmp_path / 'out'}", "global_profiler.steps=[500]")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "'global_profiler.steps'" in res.stderr and "total_training_steps=300" in res.stderr
    assert not (tmp_path / "out").exists()


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


@pytest.mark.e2e
def test_second_up_on_a_live_output_dir_is_refused_naming_the_first(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = Up([sys.executable, "-m", "rlbus", "up", f"run.output_dir={out}", "run.id=one",
                *LONG], tmp_path)
    try:
        url = first.wait_line(lambda s: s.startswith("embedded Redis at ")).split()[3]
        pids = first.pids()
        second = run_cli("up", f"run.output_dir={out}", "run.id=two", *LONG)
        assert second.returncode == 1, second.stdout + second.stderr
        errors = second.stderr.strip().splitlines()
        assert len(errors) == 1 and "in use" in errors[0] and url in errors[0], second.stderr
        assert not (out / "two").exists()
        assert all(_alive(pid) for pid in pids.values())  # the first run is untouched
        first.proc.send_signal(signal.SIGTERM)
        rc, text = first.finish()
        assert rc == 128 + signal.SIGTERM, text
        _gone(pids)
    finally:
        first.kill()


def _last_step(text: str) -> int:
    return max(int(m) for m in re.findall(r"^step +(\d+)/", text, re.M))


@pytest.mark.e2e
def test_a_continued_run_keeps_its_recorded_config(tmp_path: Path) -> None:
    out = tmp_path / "out"
    given = [*FAST, "heartbeat.timeout_s=600", "trainer.logger=[console]", "trainer.save_freq=2",
             "global_profiler.tool=torch", "global_profiler.steps=[1]",
             "trainer.total_training_steps=1000"]
    first = Up([sys.executable, "-m", "rlbus", "up", f"run.output_dir={out}", "run.id=kept",
                *given], tmp_path)
    try:
        # Both roles' traces, in either order (each is written beside its next step).
        waiting = {"trainer0", "rollouter0"}
        while waiting:
            line = first.wait_line(lambda s: s.startswith("profile s1-1 ") and ": ok " in s)
            waiting.discard(line.split()[2])
        # Step 3 or later: the profile lines may come after step 3's (a trace is written
        # while the run goes on).
        first.wait_line(lambda s: s.startswith("step ") and int(s.split()[1].split("/")[0]) >= 3)
        first.proc.send_signal(signal.SIGTERM)
        rc, text = first.finish()
        assert rc == 128 + signal.SIGTERM, text
    finally:
        first.kill()
    total = _last_step(text) + 2
    # No profiling, batch or heartbeat keys now: they come from the run's log.
    res = run_cli("up", f"run.output_dir={out}", "run.id=kept",
                  f"trainer.total_training_steps={total}", timeout_s=600)
    assert res.returncode == 0, res.stdout + res.stderr
    changes = [s.strip() for s in res.stdout.splitlines() if " -> " in s and s.startswith("  ")]
    assert changes == [f"trainer.total_training_steps: 1000 -> {total}"], res.stdout
    saved = yaml.safe_load((out / "kept" / "config.yaml").read_text())
    assert saved["redis"]["url"] is None  # never the embedded server's (gone) URL
    assert saved["trainer"]["save_freq"] == 2 and saved["trainer"]["ppo_mini_batch_size"] == 4
    assert saved["global_profiler"]["tool"] == "torch" and saved["heartbeat"]["timeout_s"] == 600
    # The resumed components report session s1-1 as past; its traces were written before.
    assert "missed" not in res.stdout, res.stdout
    assert "2 written before this session" in res.stdout, res.stdout


def test_recorded_config_keeps_recorded_keys_and_takes_location_keys_from_now() -> None:
    recorded = config_to_dict(load_config(None, [
        "trainer.save_freq=7", "global_profiler.tool=torch", "redis.url=redis://127.0.0.1:9/0",
        "run.output_dir=/elsewhere", "run.id=r"]))
    recorded["trainer"]["retired_key"] = 1  # a key an older rlbus recorded
    now = load_config(None, ["run.output_dir=/here", "run.id=r"])
    warnings: list[str] = []
    base = recorded_config(recorded, now, warnings.append)
    assert base["trainer"]["save_freq"] == 7 and base["global_profiler"]["tool"] == "torch"
    assert base["redis"]["url"] is None and base["run"]["output_dir"] == "/here"
    assert "retired_key" not in base["trainer"]
    assert len(warnings) == 1 and "'trainer.retired_key'" in warnings[0]
    merged: Any = config_to_dict(load_config(None, ["trainer.lr=0.5"], base=base))
    assert config_changes(base, merged) == [("trainer.lr", 0.001, 0.5)]


def test_a_recorded_rollout_rank_is_not_the_run_s() -> None:
    # rollout.rank is one process's: a run recorded with rank 0 (the old default) must not
    # make a rollouter started from the continued run's config.yaml ask for rank 0.
    recorded = config_to_dict(load_config(None, ["rollout.rank=0", "run.id=r"]))
    base = recorded_config(recorded, load_config(None, ["run.id=r"]), lambda _: None)
    assert base["rollout"]["rank"] is None
    assert config_changes(recorded, base) == []


@pytest.mark.e2e
def test_a_continued_run_shows_only_this_session_s_failures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    given = [*FAST, "heartbeat.timeout_s=600", "trainer.logger=[console]", "trainer.save_freq=2",
             "trainer.total_training_steps=1000"]
    first = Up([sys.executable, "-m", "rlbus", "up", f"run.output_dir={out}", "run.id=failed",
                *given], tmp_path)
    try:
        first.wait_line(lambda s: s.startswith("step ") and int(s.split()[1].split("/")[0]) >= 2)
        trainer = next(p for p in psutil.Process(first.proc.pid).children(recursive=True)
                       if "trainer" in p.cmdline())
        trainer.kill()
        rc, text = first.finish()
        assert rc != 0 and "trainer failed" in text, text
    finally:
        first.kill()
    res = run_cli("up", f"run.output_dir={out}", "run.id=failed",
                  f"trainer.total_training_steps={_last_step(text) + 2}", timeout_s=600)
    assert res.returncode == 0, res.stdout + res.stderr
    said = res.stdout + res.stderr
    assert "trainer failed" not in said and "the run stops" not in said, said
    assert "0 warning(s)" in said, said  # the summary counts this session's
