"""docker-compose.yml cannot be `up`-ed here (no Docker engine), so run every command in it as
a local process, with the environment compose would give it, against a redis-server >= 7
started by the same script with the same ACL file, and check the run completes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from bus import Bus, RunKeys, RunStarted
from bus.history import find_archive, read_history
from tests.compose_redis import ROOT, USERS, AclRedis, acl_env, interpolate, password
from tests.procs import Procs

COMPONENTS = {"profiler", "logger", "trainer", "rollouter0", "rollouter1"}


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_service_is_secured_and_runs_an_rlbus_command() -> None:
    services = _compose()["services"]
    assert {"redis", *COMPONENTS} <= set(services)
    assert 'ENTRYPOINT ["rlbus"]' in (ROOT / "Dockerfile").read_text()
    redis_svc = services["redis"]
    assert redis_svc["command"][:2] == ["sh", "/etc/rlbus/start-redis.sh"]
    script = (ROOT / "deploy" / "redis" / "start-redis.sh").read_text()
    for flag in ("--aclfile", "--appendfsync everysec", "--maxmemory-policy noeviction"):
        assert flag in script, flag
    for name in COMPONENTS:
        svc = services[name]
        assert svc["command"][0] in {"trainer", "rollouter", "profiler", "logger"}, name
        url = next(a for a in svc["command"] if a.startswith("redis.url="))
        user = svc["command"][0]
        # The password is the service's own, from the environment, expanded by rlbus.
        assert url == f"redis.url=redis://{user}:$${{RLBUS_REDIS_PASSWORD}}@redis:6379/0", name
        assert svc["environment"]["RLBUS_REDIS_PASSWORD"].startswith(
            f"${{RLBUS_{user.upper()}_PASSWORD:?"), name


@pytest.mark.e2e
def test_compose_commands_run_as_local_processes(
    tmp_path: Path, redis7_binary: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = _compose()["services"]
    env = acl_env(run_id)
    server = AclRedis(redis7_binary, tmp_path / "redis", run_id)
    procs = Procs(tmp_path / "logs")
    out = tmp_path / "outputs"
    # Shorter than the compose run, same commands: later overrides win.
    short = ["trainer.total_training_steps=3", "global_profiler.steps=[1,3]",
             "trainer.ppo_mini_batch_size=4", "rollout.n=4", "heartbeat.timeout_s=20"]
    try:
        for name in sorted(COMPONENTS):
            svc = services[name]
            for key, value in svc.get("environment", {}).items():
                monkeypatch.setenv(key, interpolate(str(value), env))  # as compose would
            argv = [interpolate(a, env).replace("@redis:6379/", f"@127.0.0.1:{server.port}/")
                    for a in svc["command"]]
            argv = [f"run.output_dir={out}" if a.startswith("run.output_dir=") else a
                    for a in argv]
            procs.spawn(name, "rlbus", *argv, *short)
        for name in ("trainer", "rollouter0", "rollouter1", "profiler", "logger"):
            assert procs.wait(name, 240) == 0, procs.log(name)
        manifest = json.loads((out / "profiles" / run_id / "manifest.json").read_text())
        done = {(s["role"], s["rank"], s["first_step"]) for s in manifest["sessions"]
                if s["status"] == "ok"}
        # Step 1 on both roles; a replica that starts after step 1 is over has no step 1.
        assert {("trainer", 0, 1), ("trainer", 0, 3)} <= done
        assert any(role == "rollouter" and first == 1 for role, _, first in done)
        assert "trainer: step    3/3" in procs.log("trainer")  # its own progress lines
        assert list((out / run_id / "tensorboard").glob("events.out.tfevents.*"))
        # No password in any log, nor in the run's log (RunStarted keeps the placeholder).
        for name in COMPONENTS:
            for user in USERS:
                assert password(user) not in procs.log(name), (name, user)
        started = asyncio.run(_run_started(server.url("admin"), run_id))
        assert "${RLBUS_REDIS_PASSWORD}" in started.config["redis"]["url"]
        assert password("trainer") not in json.dumps(started.config)
    finally:
        procs.kill_all()
        server.stop()


async def _run_started(url: str, run_id: str) -> RunStarted:
    bus = Bus.from_url(url)
    try:
        keys = RunKeys(run_id)
        # Retention archived the log's beginning: read the archive, then the stream.
        async for _, msg in read_history(bus, keys.events, await find_archive(bus, keys, None)):
            if isinstance(msg, RunStarted):
                return msg
        raise AssertionError("no RunStarted")
    finally:
        await bus.close()
