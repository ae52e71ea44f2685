"""docker-compose.yml cannot be `up`-ed here (no Docker engine), so run every command in it as
a local process, with the environment compose would give it, against a redis-server >= 7
started by the same script with the same ACL file, and check the run completes."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import redis
import yaml

from bus import Bus, RunKeys
from runschema.messages import FIELD, RunFinished, RunStarted, StepFinished, encode
from runtime.history import find_archive, read_history
from tests.compose_redis import (
    ROOT,
    USERS,
    AclRedis,
    acl_env,
    interpolate,
    local_argv,
    password,
)
from tests.procs import Procs
from tests.waits import event, wait_for

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
            argv = local_argv(svc["command"], env, "redis", server.port, out)
            procs.spawn(name, "rlbus", *argv, *short)
        asyncio.run(_forge_while_it_runs(server, run_id, procs))
        for name in ("trainer", "rollouter0", "rollouter1", "profiler", "logger"):
            assert procs.wait(name, 240) == 0, procs.log(name)
        # The forgeries the ACL let in (a role's own stream) were refused by every reader.
        for name in ("trainer", "rollouter0", "rollouter1", "profiler"):
            assert "may not state RunFinished" in procs.log(name), (name, procs.log(name))
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


FORGED = encode(RunFinished(run_id="forged", steps=10**9))


def _refused_forgeries(c: redis.Redis, keys: RunKeys) -> None:
    """Each forgery of issue 22 with ``c``'s credentials: refused by Redis."""
    for forgery in (lambda: c.xadd(keys.events, {FIELD: FORGED}),
                    lambda: c.set(keys.events, b"gone"),
                    lambda: c.pexpire(keys.samples, 1),
                    lambda: c.set(keys.alive("trainer", 0), b"alive"),
                    lambda: c.scan(0)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forgery()


async def _forge_while_it_runs(server: AclRedis, run_id: str, procs: Procs) -> None:
    """Once step 1 finished: every non-trainer user tries to state trainer facts; Redis
    refuses each. The one append it allows (a RunFinished in the rollouters' own stream,
    which any rollouter may write) is refused by every reader (runschema.authority)."""
    keys = RunKeys(run_id)
    admin = Bus.from_url(server.url("admin"))
    try:
        await wait_for(admin, keys.events, event(StepFinished, step=1), 180,
                       procs.watch("trainer"))
    finally:
        await admin.close()
    for user in ("rollouter", "profiler", "logger", "operator"):
        c = server.client(user)
        try:
            _refused_forgeries(c, keys)
        finally:
            c.close()
    rollouter = server.client("rollouter")
    try:
        rollouter.xadd(keys.log("rollouter"), {FIELD: FORGED})
    finally:
        rollouter.close()


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


def test_the_image_holds_every_package_the_project_installs() -> None:
    # docker-compose.yml's image is built from the Dockerfile: a package it does not copy is
    # an import error in every container (runtime/ was missing).
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {p.rstrip("*") for p in setup["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert packages == copied, (packages - copied, copied - packages)
