"""Redis Cluster: URL forms, a plain URL at a cluster node, two runs at once on a 3-master
cluster (both finish and learn, their keys on different masters), ACL users on a cluster."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.crc import key_slot
from redis.exceptions import ClusterDownError

from bus import Bus, BusClusterError, RunKeys, acl_rules, as_cluster_url, split_cluster
from runconfig import ConfigError, load_config
from runschema.messages import RunFinished, RunStarted, StepFinished, WeightsPublished
from runtime.process import expanded_url
from tests.procs import FAST, Procs, assert_every_step_once, events_of, run_cli
from tests.redis_cluster import SLOTS, LocalCluster
from tests.waits import event, wait_for

STEPS = 3


@pytest.fixture(scope="module")
def cluster(redis7_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(redis7_binary, tmp_path_factory.mktemp("cluster")) as c:
        yield c


def _master(run: str, masters: int = 3) -> int:
    """Which master (0..masters-1) holds ``run``'s keys, by the slot split LocalCluster makes."""
    return key_slot(RunKeys(run).events.encode()) * masters // SLOTS


def _runs_on_two_masters() -> tuple[str, str]:
    names = [f"cl-run-{i}" for i in range(20)]
    first = names[0]
    other = next(n for n in names if _master(n) != _master(first))
    return first, other


# --------------------------------------------------------------------------- URL forms


def test_url_forms() -> None:
    assert split_cluster("redis+cluster://u:p@h:7000/0") == ("redis://u:p@h:7000/0", True)
    assert split_cluster("rediss+cluster://h:7000") == ("rediss://h:7000", True)
    assert split_cluster("redis://h:6380/0") == ("redis://h:6380/0", False)
    assert split_cluster("unix:///tmp/r.sock") == ("unix:///tmp/r.sock", False)
    assert as_cluster_url("redis://h:7000/0") == "redis+cluster://h:7000/0"
    assert as_cluster_url("rediss+cluster://h:7000") == "rediss+cluster://h:7000"
    with pytest.raises(ValueError, match="unix://"):
        as_cluster_url("unix:///tmp/r.sock")


def test_redis_cluster_key_gives_the_cluster_url_and_is_checked() -> None:
    cfg = load_config(None, ["redis.url=redis://h:7000/0", "redis.cluster=true"])
    assert expanded_url(cfg) == "redis+cluster://h:7000/0"
    assert expanded_url(load_config(None, ["redis.url=redis://h:7000/0"])) == "redis://h:7000/0"
    with pytest.raises(ConfigError, match=r"redis\.url"):
        load_config(None, ["redis.url=unix:///tmp/r.sock", "redis.cluster=true"])
    with pytest.raises(ConfigError, match=r"redis\.cluster"):
        load_config(None, ["redis.cluster=true"])


# --------------------------------------------------------------------------- a wrong form


@pytest.mark.asyncio
async def test_a_plain_url_at_a_cluster_node_is_a_named_error(cluster: LocalCluster) -> None:
    bus = Bus.from_url(cluster.plain_url(1))
    try:
        with pytest.raises(BusClusterError, match="names a node of a Redis Cluster"):
            await bus.ping()
    finally:
        await bus.close()


@pytest.mark.asyncio
async def test_a_moved_reply_to_a_plain_client_is_the_same_named_error(
    cluster: LocalCluster
) -> None:
    """Without the ping's check (a user without CLUSTER MYID), the first key of another
    master's slot is still the named error, not redis-py's MovedError."""
    run = next(f"cl-moved-{i}" for i in range(20) if _master(f"cl-moved-{i}") != 0)
    bus = Bus.from_url(cluster.plain_url(0))
    try:
        with pytest.raises(BusClusterError, match="use redis\\+cluster://"):
            await bus.command("XLEN", RunKeys(run).events)
    finally:
        await bus.close()


@pytest.mark.procs
def test_a_component_at_a_cluster_node_with_a_plain_url_exits_2_in_one_line(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    r = run_cli("trainer", f"redis.url={cluster.plain_url(0)}", "run.id=plain-at-cluster",
                f"run.output_dir={tmp_path}")
    assert r.returncode == 2, r.stderr
    assert "use redis+cluster:// or redis.cluster: true" in r.stderr
    assert "Traceback" not in r.stderr and "MovedError" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.asyncio
async def test_a_cluster_url_at_a_single_server_is_a_named_error(redis_url: str) -> None:
    bus = Bus.from_url(as_cluster_url(redis_url))
    try:
        with pytest.raises(BusClusterError, match="not a Redis Cluster node"):
            await bus.ping()
    finally:
        await bus.close()


# --------------------------------------------------------------------------- two runs at once


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_two_runs_at_once_on_a_cluster_both_learn_on_different_masters(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    runs = _runs_on_two_masters()
    procs = Procs(tmp_path / "logs")
    try:
        for i, run in enumerate(runs):
            # One run names the cluster by its URL form, the other by redis.cluster: true.
            url = (cluster.url if i == 0 else cluster.plain_url(2))
            args = [f"redis.url={url}", *(["redis.cluster=true"] if i else []),
                    f"run.id={run}", f"run.output_dir={tmp_path / run}", *FAST,
                    f"trainer.total_training_steps={STEPS}"]
            procs.spawn(f"rollouter-{run}", "rollouter", *args)
            procs.spawn(f"trainer-{run}", "trainer", *args)
        for run in runs:
            assert procs.wait(f"trainer-{run}", 240) == 0, procs.log(f"trainer-{run}")
            assert procs.wait(f"rollouter-{run}", 60) == 0, procs.log(f"rollouter-{run}")
    finally:
        procs.kill_all()

    async with Bus.from_url(cluster.url) as bus:
        for run in runs:
            events = await events_of(bus, RunKeys(run).events)
            steps = [e for e in events if isinstance(e, StepFinished)]
            assert [e.step for e in steps] == list(range(1, STEPS + 1)), run
            assert any(isinstance(e, RunFinished) for e in events), run
            # It learned: every step updated the weights (a finite, non-zero gradient) and
            # published a new version.
            for e in steps:
                assert math.isfinite(e.metrics["actor/grad_norm"]), (run, e.metrics)
                assert e.metrics["actor/grad_norm"] > 0, (run, e.metrics)
            published = [e.version for e in events if isinstance(e, WeightsPublished)]
            assert published == list(range(STEPS + 1)), (run, published)
        # The run-independent discovery stream names both runs.
        started = {m.run_id async for _, m in bus.read_all("rlbus:runs")
                   if isinstance(m, RunStarted)}
        assert set(runs) <= started

    # Each run's keys are on its own master, and only there.
    holders = []
    for run in runs:
        on = [i for i in range(cluster.masters)
              if cluster.client(i).keys(f"rlbus:{{{run}}}:*")]
        assert len(on) == 1, (run, on)
        holders.append(on[0])
    assert holders[0] != holders[1], holders
    assert holders == [_master(r) for r in runs]


# --------------------------------------------------------------------------- ACL users


def test_acl_users_work_on_a_cluster(cluster: LocalCluster) -> None:
    """The component users' rules, loaded on every master, let a cluster client connect
    (slot table, command table) and do a component's work on the run's master."""
    run = "cl-acl"
    rules = acl_rules(run)
    for i in range(cluster.masters):
        for user in ("trainer", "operator"):
            cluster.client(i).execute_command("ACL", "SETUSER", user, "reset", "on", ">pw",
                                              *rules[user].split())
    host_port = cluster.url.split("://", 1)[1]

    async def work() -> None:
        async with Bus.from_url(f"redis+cluster://trainer:pw@{host_port}") as bus:
            await bus.ping()
            keys = RunKeys(run)
            await bus.pipeline([("XADD", keys.events, "*", "f", "v"),
                                ("XADD", keys.samples, "*", "f", "v")], atomic=True)
            await bus.publish(keys.events, RunFinished(run_id=run, steps=0))
            await bus.publish("rlbus:runs", RunStarted(run_id=run, config={}))
        async with Bus.from_url(f"redis+cluster://operator:pw@{host_port}") as bus:
            await bus.ping()
            assert await bus.command("XLEN", RunKeys(run).events) == 2

    asyncio.run(work())


# --------------------------------------------------------------------------- a master down


@pytest.mark.asyncio
async def test_a_cluster_without_a_master_is_bus_unavailable_after_retries(
    redis7_binary: str, tmp_path: Path
) -> None:
    """CLUSTERDOWN (a master lost, no replica to promote) is retried like an unreachable
    server and ends as BusUnavailable naming the command, not a redis-py traceback."""
    from bus import BusUnavailable, RetryPolicy

    with LocalCluster(redis7_binary, tmp_path, extra=("--cluster-node-timeout", "500")) as c:
        run = next(f"cl-down-{i}" for i in range(20) if _master(f"cl-down-{i}") == 0)
        bus = Bus.from_url(c.url, retry=RetryPolicy(attempts=3, base_s=0.05, max_s=0.2))
        try:
            await bus.ping()
            c._procs[2].kill()  # the last master: its slots are no longer served
            c._procs[2].wait()
            deadline = asyncio.get_running_loop().time() + 30
            while c.client(0).execute_command("CLUSTER INFO")["cluster_state"] != "fail":
                assert asyncio.get_running_loop().time() < deadline, "cluster_state never fail"
                await asyncio.sleep(0.1)
            with pytest.raises(BusUnavailable, match="XLEN failed after 3 attempt") as err:
                await bus.command("XLEN", RunKeys(run).events)
            assert isinstance(err.value.__cause__, ClusterDownError), repr(err.value.__cause__)
        finally:
            await bus.close()


# --------------------------------------------------------------------------- a slot moves


@pytest.mark.asyncio
async def test_a_runs_transaction_follows_its_slot_to_another_master(
    redis7_binary: str, tmp_path: Path
) -> None:
    """A pipeline goes to the master of its slot (not through redis-py's cluster pipeline);
    when the slot has moved, the MOVED answer makes it read the slot table and go again."""
    with LocalCluster(redis7_binary, tmp_path) as c:
        run = next(f"cl-move-{i}" for i in range(20) if _master(f"cl-move-{i}") == 0)
        keys = RunKeys(run)
        async with Bus.from_url(c.url) as bus:
            add = [("XADD", keys.events, "*", "f", "v"), ("XADD", keys.samples, "*", "f", "v")]
            await bus.pipeline(add, atomic=True)
            # Move the (now empty) slot from master 0 to master 1.
            await bus.delete(keys.events, keys.samples)
            slot = key_slot(keys.events.encode())
            target = c.client(1).execute_command("CLUSTER MYID")
            target = target.decode() if isinstance(target, bytes) else target
            for i in (1, 0, 2):
                c.client(i).execute_command("CLUSTER SETSLOT", slot, "NODE", target)
            assert len(await bus.pipeline(add, atomic=True)) == 2
        assert c.client(1).xlen(keys.events) == 1  # on master 1 now (master 0 answers MOVED)
        assert c.client(0).execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 0


@pytest.mark.asyncio
async def test_server_wide_commands_ask_the_master_holding_the_run(cluster: LocalCluster) -> None:
    # The URL names node 0; the run's keys live on another master, whose clock stamps its
    # entry ids (the profiler compares TIME with them) and whose memory holds them.
    run = next(f"home-{i}" for i in range(50)
               if cluster.node_of(RunKeys(f"home-{i}").events) != cluster.ports[0])
    home = cluster.node_of(RunKeys(run).events)
    bus = Bus.from_url(cluster.url)
    try:
        info = await bus.command("INFO", "server")
        assert int(info["tcp_port"]) == cluster.ports[0]  # no home key: the URL's node
        bus.home_key = RunKeys(run).events
        info = await bus.command("INFO", "server")
        assert int(info["tcp_port"]) == home
        assert await bus.server_time() > 0
    finally:
        await bus.close()


# --------------------------------------------------------------------------- a master fails over


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.asyncio
async def test_a_run_goes_on_when_its_master_fails_over_to_its_replica(
    redis7_binary: str, tmp_path: Path
) -> None:
    """3 masters with a replica each: the master holding the run is SIGKILLed mid-run, its
    replica is promoted, and the run finishes on it: steps finish after the kill, every step
    once, no sample trained twice, the replica now the run's master."""
    steps = 100  # ~10 s of run left after step 2: the failover (~2-3 s) lands inside it
    with LocalCluster(redis7_binary, tmp_path / "cluster", replicas=1,
                      extra=("--cluster-node-timeout", "1000")) as c:
        # Not the URL's node: new connections still find the cluster through it.
        run = next(f"cl-fo-{i}" for i in range(40) if _master(f"cl-fo-{i}") == 1)
        args = [f"redis.url={c.url}", f"run.id={run}", f"run.output_dir={tmp_path / 'out'}",
                *FAST, f"trainer.total_training_steps={steps}"]
        procs = Procs(tmp_path / "logs")
        try:
            procs.spawn("rollouter0", "rollouter", *args)
            procs.spawn("trainer", "trainer", *args)
            async with Bus.from_url(c.url) as bus:
                await wait_for(bus, RunKeys(run).events, event(StepFinished, step=2), 180,
                               procs.watch("trainer", "rollouter0"))
            c.kill(1)
            killed = time.time()
            assert procs.wait("trainer", 300) == 0, procs.log("trainer")
            assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
        finally:
            procs.kill_all()
        replica = c.client(c.replica_of(1))
        assert replica.info("replication")["role"] == "master"
        assert replica.exists(RunKeys(run).events)  # the run lives on the promoted replica
        async with Bus.from_url(c.url) as bus:
            events = await events_of(bus, RunKeys(run).events)
        assert_every_step_once(events, steps)
        after = [e.step for e in events if isinstance(e, StepFinished) and e.ts > killed]
        assert after and after[-1] == steps, "no step finished after the master was killed"
        assert len(after) < steps - 1, "the master was killed too late to matter"
        assert any(isinstance(e, RunFinished) and e.ts > killed for e in events)
