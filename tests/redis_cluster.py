"""A throwaway Redis Cluster for tests: ``LocalCluster`` starts N masters on free 127.0.0.1
ports, each a redis-server with ``cluster-enabled yes`` and its own directory, splits the 16384
slots evenly (CLUSTER ADDSLOTSRANGE), joins them (CLUSTER MEET) and waits, bounded, until every
node says ``cluster_state:ok`` and knows every other. With ``replicas=R`` it then starts R
replicas per master (CLUSTER MEET, CLUSTER REPLICATE) and waits until each master has its
replicas in sync, so that killing a master promotes one of them.

>>> with LocalCluster(binary, tmp_path) as c:  # doctest: +SKIP
...     c.url          # redis+cluster://127.0.0.1:PORT/0 (the first node)
...     c.node_of(key) # the port of the master owning ``key``'s slot
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import redis

from rlbus.redis_binary import free_port

SLOTS = 16384
READY_S = 30.0


class LocalCluster:
    """``masters`` redis-servers joined into one cluster; ``password`` sets requirepass and
    masterauth on each (the same on all, as a cluster needs)."""

    def __init__(self, binary: str, dir: Path, masters: int = 3, password: str | None = None,
                 extra: tuple[str, ...] = (), replicas: int = 0) -> None:
        self.binary = binary
        self.dir = dir
        self.masters = masters
        self.replicas = replicas
        self.password = password
        self.extra = extra
        self.ports: list[int] = []
        self.bus_ports: list[int] = []
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """``redis+cluster://`` naming the first node (the client discovers the others)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis+cluster://{auth}127.0.0.1:{self.ports[0]}/0"

    def plain_url(self, i: int = 0) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.ports[i]}/0"

    def client(self, i: int) -> redis.Redis:
        return redis.Redis(port=self.ports[i], password=self.password)

    def node_of(self, key: str) -> int:
        """The port of the master owning ``key``'s slot (CLUSTER KEYSLOT, then the slot table)."""
        slot = int(self.client(0).execute_command("CLUSTER KEYSLOT", key))
        return self.ports[slot * self.masters // SLOTS]

    def _spawn(self, i: int) -> None:
        port, bus_port = free_port(), free_port()
        self.bus_ports.append(bus_port)
        node_dir = self.dir / f"node-{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        # The bus port's own free port (not PORT+10000, which may be taken or > 65535).
        args = [self.binary, "--port", str(port), "--bind", "127.0.0.1",
                "--dir", str(node_dir), "--cluster-enabled", "yes",
                "--cluster-port", str(bus_port), "--cluster-config-file", "nodes.conf",
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                # A replica's first sync starts at once (Redis 7 waits 5 s for more replicas).
                "--repl-diskless-sync-delay", "0",
                "--logfile", str(node_dir / "redis.log"), *self.extra]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        self._procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        self.ports.append(port)

    def start(self) -> Self:
        for i in range(self.masters):
            self._spawn(i)
        self._wait(lambda c: c.ping(), "every node to answer PING")
        for i in range(self.masters):
            lo, hi = i * SLOTS // self.masters, (i + 1) * SLOTS // self.masters - 1
            c = self.client(i)
            c.execute_command("CLUSTER ADDSLOTSRANGE", lo, hi)
            if i:
                c.execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0], self.bus_ports[0])
        self._wait(self._ready, "cluster_state:ok and every node known to every node")
        if self.replicas:
            self._add_replicas()
        return self

    def _add_replicas(self) -> None:
        """Replica ``masters + m * replicas + k`` follows master ``m``."""
        ids = [self._id(i) for i in range(self.masters)]
        for m in range(self.masters):
            for _ in range(self.replicas):
                i = len(self.ports)
                self._spawn(i)
                self._wait_node(i, lambda c: c.ping(), "a replica to answer PING")
                self.client(i).execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0],
                                               self.bus_ports[0])
                master = ids[m]
                self._wait_node(i, lambda c, master=master: master in str(c.execute_command(
                    "CLUSTER NODES")), "a replica to know its master")
                self.client(i).execute_command("CLUSTER REPLICATE", ids[m])
        # In sync: the replica's link is up once its first full sync is done. A master's
        # connected_slaves counts a replica still waiting for that sync, and a replica that
        # never synced cannot be promoted ("disconnected from master for longer than allowed").
        for i in range(self.masters, len(self.ports)):
            self._wait_node(i, lambda c: c.info("replication").get("master_link_status") == "up",
                            "a replica's first sync with its master")
        self._wait(self._ready, "every node known to every node")

    def _id(self, i: int) -> str:
        raw = self.client(i).execute_command("CLUSTER MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def replica_of(self, m: int) -> int:
        """The index of master ``m``'s first replica."""
        return self.masters + m * self.replicas

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (a master's failover then promotes its replica)."""
        self._procs[i].kill()
        self._procs[i].wait()

    def _ready(self, c: redis.Redis) -> bool:
        info = c.execute_command("CLUSTER INFO")  # parsed into a dict by redis-py
        return (str(info.get("cluster_state")) == "ok"
                and int(info.get("cluster_known_nodes", 0)) == len(self.ports))

    def _wait_node(self, i: int, check: object, what: str) -> None:
        self._wait(check, f"{what} (node {i})", nodes=[i])

    def _wait(self, check: object, what: str, nodes: list[int] | None = None) -> None:
        """Until ``check(client)`` holds on every node of ``nodes`` (the masters by
        default), bounded by :data:`READY_S`."""
        deadline = time.monotonic() + READY_S
        for_nodes = range(self.masters) if nodes is None else nodes
        while True:
            try:
                if all(check(self.client(i)) for i in for_nodes):  # type: ignore[operator]
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"LocalCluster: gave up after {READY_S:g} s waiting for {what}"
                                   f" (logs under {self.dir})")
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
