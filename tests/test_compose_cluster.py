"""docker-compose.cluster.yml cannot be `up`-ed here (no Docker engine), so run its commands
as local processes with the environment compose would give them: six redis-servers through
deploy/redis/start-redis.sh (as cluster nodes, each with the ACL users), cluster-init's
deploy/redis/create-cluster.sh forming them into three masters with a replica each, then
the components, each naming the cluster by one node; the run completes on its slot's master
and is replicated."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
import redis
import yaml

from bus import Bus, RunKeys
from rlbus.redis_binary import free_port
from runschema.messages import Message, RunFinished
from tests.compose_redis import (
    ROOT,
    USERS,
    AclRedis,
    acl_env,
    interpolate,
    local_argv,
    password,
)
from tests.procs import Procs, assert_every_step_once, events_of

COMPONENTS = ("profiler", "logger", "trainer", "rollouter0", "rollouter1")
NODES = [f"redis-{i}" for i in range(6)]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.cluster.yml").read_text())


def test_every_node_is_a_secured_cluster_node_and_every_component_names_the_cluster() -> None:
    services = _compose()["services"]
    assert {*NODES, "cluster-init", *COMPONENTS} <= set(services)
    for name in NODES:
        node = services[name]
        assert node["command"][:2] == ["sh", "/etc/rlbus/start-redis.sh"], name
        assert node["environment"]["RLBUS_REDIS_CLUSTER"] == "yes", name
        assert f"{name}:/data" in node["volumes"], name  # its identity and AOF survive it
    init = services["cluster-init"]
    assert init["command"][:2] == ["sh", "/etc/rlbus/create-cluster.sh"]
    assert init["command"][2:] == [f"{n}:6379" for n in NODES]
    assert set(init["depends_on"]) == set(NODES)
    for name in COMPONENTS:
        svc = services[name]
        user = svc["command"][0]
        url = next(a for a in svc["command"] if a.startswith("redis.url="))
        assert url == f"redis.url=redis+cluster://{user}:$${{RLBUS_REDIS_PASSWORD}}@redis-0:6379/0"
        assert svc["depends_on"] == {"cluster-init": {"condition":
                                                      "service_completed_successfully"}}


def _start_nodes(binary: str, dir: Path, run_id: str, services: dict) -> list[AclRedis]:
    nodes: list[AclRedis] = []
    for name in NODES:
        svc = services[name]
        env = {k: interpolate(str(v), acl_env(run_id)) for k, v in svc["environment"].items()}
        # The compose node's arguments, after the server command; its own ports here (the
        # bus port too: PORT+10000 may be taken).
        extra = [*svc["command"][4:], "--cluster-port", str(free_port())]
        nodes.append(AclRedis(binary, dir / name, run_id, extra=extra, env=env))
    return nodes


def _create_cluster(nodes: list[AclRedis], run_id: str, init: dict) -> str:
    """cluster-init's command, with the nodes' local addresses for the service names."""
    assert init["command"][2:] == [f"{name}:6379" for name in NODES]
    addresses = [f"127.0.0.1:{n.port}" for n in nodes]
    script = ROOT / "deploy" / "redis" / "create-cluster.sh"
    env = {**os.environ, **{k: interpolate(str(v), acl_env(run_id))
                            for k, v in init["environment"].items()}}
    r = subprocess.run(["sh", str(script), *addresses], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert password("admin") not in r.stdout + r.stderr
    return r.stdout


@pytest.mark.e2e
def test_compose_cluster_commands_run_as_local_processes(
    tmp_path: Path, redis7_binary: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = _compose()["services"]
    env = acl_env(run_id)
    nodes = _start_nodes(redis7_binary, tmp_path / "redis", run_id, services)
    procs = Procs(tmp_path / "logs")
    out = tmp_path / "outputs"
    short = ["trainer.total_training_steps=3", "global_profiler.steps=[1]",
             "trainer.ppo_mini_batch_size=4", "rollout.n=4", "heartbeat.timeout_s=20"]
    try:
        said = _create_cluster(nodes, run_id, services["cluster-init"])
        assert "cluster_state:ok" in said, said
        # A second `compose up`: the formed cluster is left as it is.
        again = _create_cluster(nodes, run_id, services["cluster-init"])
        assert "already formed" in again, again
        for name in COMPONENTS:
            svc = services[name]
            for key, value in svc.get("environment", {}).items():
                monkeypatch.setenv(key, interpolate(str(value), env))
            argv = local_argv(svc["command"], env, "redis-0", nodes[0].port, out)
            procs.spawn(name, "rlbus", *argv, *short)
        for name in ("trainer", "rollouter0", "rollouter1", "profiler", "logger"):
            assert procs.wait(name, 240) == 0, procs.log(name)
        for name in COMPONENTS:
            for user in USERS:
                assert password(user) not in procs.log(name), (name, user)
        admin_url = f"redis+cluster://admin:{password('admin')}@127.0.0.1:{nodes[0].port}/0"
        events = asyncio.run(_events(admin_url, run_id))
        assert_every_step_once(events, 3)
        assert any(isinstance(e, RunFinished) for e in events)
        _assert_on_one_master_and_its_replica(nodes, run_id)
    finally:
        procs.kill_all()
        for n in nodes:
            n.stop()


async def _events(url: str, run_id: str) -> list[Message]:
    async with Bus.from_url(url) as bus:
        return await events_of(bus, RunKeys(run_id).events)


def _assert_on_one_master_and_its_replica(nodes: list[AclRedis], run_id: str) -> None:
    """The run's keys are on one master, and on that master's replica once it caught up."""
    pattern = f"rlbus:{{{run_id}}}:*"
    holders = []
    for n in nodes:
        c = redis.Redis(port=n.port, username="admin", password=password("admin"),
                        socket_timeout=60)
        try:
            if c.info("replication")["role"] == "master" and c.keys(pattern):
                # Until its replica acknowledged every write (its first sync may still be
                # under way: Redis waits 5 s for more replicas before it starts one).
                assert c.execute_command("WAIT", 1, 30_000) == 1, "the replica did not catch up"
        finally:
            c.close()
    for n in nodes:
        c = redis.Redis(port=n.port, username="admin", password=password("admin"))
        try:
            if c.keys(pattern):
                holders.append((n.port, c.info("replication")["role"]))
        finally:
            c.close()
    assert sorted(role for _, role in holders) == ["master", "slave"], holders
