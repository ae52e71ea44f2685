"""The `rlbus` command line: sub-commands start, stop and refuse bad input as documented."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rlbus.cli import COMMANDS, main
from tests.procs import run_cli


@pytest.mark.procs
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


@pytest.mark.procs
def test_help_and_unknown_command() -> None:
    ok = run_cli("--help")
    assert ok.returncode == 0 and "rlbus up" not in ok.stderr and "inspect" in ok.stdout
    bad = run_cli("frobnicate")
    assert bad.returncode == 2 and "unknown command" in bad.stderr


@pytest.mark.procs
def test_profile_bad_spec_and_roles_exit_2() -> None:
    res = run_cli("profile", "--run", "r1", "--steps", "0-x", "redis.url=redis://127.0.0.1:1/0")
    assert res.returncode == 2 and "--steps" in res.stderr, res.stderr
    res = run_cli("profile", "--run", "r1", "--steps", "3", "--roles", "gpu",
                  "redis.url=redis://127.0.0.1:1/0")
    assert res.returncode == 2 and "--roles" in res.stderr, res.stderr


@pytest.mark.procs
def test_inspect_unknown_run_says_so(tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()  # an output folder with embedded Redis data, not this run's
    res = run_cli("inspect", "--run", "nothing-here", f"run.output_dir={tmp_path}")
    assert res.returncode == 1 and "no events" in res.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help_pointing_at_the_config_reference(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: rlbus {command}") and "docs/config.md" in out


def test_config_prints_the_effective_config_and_one_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config", "trainer.lr=0.5", "redis.url=redis://u:s3cret@h:6379/0"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out and "s3cret" not in out and "redis://u:***@h:6379/0" in out
    assert main(["config", "--show", "global_profiler.steps", "global_profiler.steps=[1,3]"]) == 0
    assert capsys.readouterr().out == "[1, 3]\n"
    assert main(["config", "--show", "trainer.lrr"]) == 2
    assert "did you mean 'trainer.lr'" in capsys.readouterr().err


def test_config_show_takes_verl_keys_and_says_what_they_are_here(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Asked in verl's name: the rlbus key it is and its effective value.
    assert main(["config", "--show", "actor_rollout_ref.actor.optim.lr", "trainer.lr=0.25"]) == 0
    assert capsys.readouterr().out == ("actor_rollout_ref.actor.optim.lr is verl's name of "
                                       "trainer.lr:\ntrainer.lr: 0.25\n")
    assert main(["config", "--show", "data.max_response_length"]) == 0
    assert "derived" in capsys.readouterr().out
    assert main(["config", "--show", "actor_rollout_ref.actor.optim.lrr"]) == 2
    assert "unknown config key" in capsys.readouterr().err


def test_config_show_prints_how_a_verl_key_derived_the_run_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = ["async_training.staleness_threshold=0.1", "async_training.require_batches=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "rollout.total_rollout_steps=64",
            "rollout.max_new_tokens=5"]
    how = ("# trainer.total_training_steps=8: 64 prompts (of rollout.total_rollout_steps=64) "
           "// 8 a step (ppo_mini_batch_size x require_batches), as verl's fully-async "
           "trainer counts them\n")
    assert main(["config", "--show", "trainer.total_training_steps", *line]) == 0
    assert capsys.readouterr().out == "8\n" + how  # the value, then how (a YAML comment)
    assert main(["config", "--show", "rollout.total_rollout_steps", *line]) == 0
    assert capsys.readouterr().out == ("rollout.total_rollout_steps (verl's) set these rlbus "
                                       "keys:\ntrainer.total_training_steps: 8\n" + how)
    # A classic line: what data.train_batch_size set, the epochs' batch among it.
    classic = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
               "rollout.max_new_tokens=5"]
    assert main(["config", "--show", "data.train_batch_size", *classic]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "async_training.require_batches: 2", "async_training.trigger_parameter_sync_step: 1",
        "async_training.staleness_threshold: 0.0", "data.epoch_batch_size: 8"]
    assert main(["config", "--show", "data.epoch_batch_size", *classic]) == 0
    assert capsys.readouterr().out == "8\n# derived from data.train_batch_size\n"
    assert main(["config", "--show", "trainer.total_training_steps", "trainer.lr=0.1"]) == 0
    assert capsys.readouterr().out == "300\n"  # given or a default: no derivation


def test_password_from_the_environment_is_never_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RLBUS_TEST_PW", "s3cret")
    url = "redis.url=redis://u:${RLBUS_TEST_PW}@127.0.0.1:1/0"
    assert main(["inspect", "--run", "x", url]) == 1
    err = capsys.readouterr().err
    assert "s3cret" not in err and "redis://u:***@127.0.0.1:1/0" in err
    monkeypatch.delenv("RLBUS_TEST_PW")
    assert main(["inspect", "--run", "x", url]) == 2
    assert "RLBUS_TEST_PW" in capsys.readouterr().err


@pytest.mark.procs
@pytest.mark.parametrize("module", ["trainer", "rollouter", "profiler_service", "metrics_logger"])
def test_python_m_component_help(module: str) -> None:
    res = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage:") and "docs/config.md" in res.stdout
