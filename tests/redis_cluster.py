"""A throwaway Redis Cluster for tests: ``LocalCluster`` starts N masters (no replicas) on free
127.0.0.1 ports, each a redis-server with ``cluster-enabled yes`` and its own directory, splits
the 16384 slots evenly (CLUSTER ADDSLOTSRANGE), joins them (CLUSTER MEET) and waits, bounded,
until every node says ``cluster_state:ok`` and knows every other.

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

from bus.redisbin import free_port

SLOTS = 16384
READY_S = 30.0


class LocalCluster:
    """``masters`` redis-servers joined into one cluster; ``password`` sets requirepass and
    masterauth on each (the same on all, as a cluster needs)."""

    def __init__(self, binary: str, dir: Path, masters: int = 3, password: str | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.dir = dir
        self.masters = masters
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

    def start(self) -> Self:
        for i in range(self.masters):
            port, bus_port = free_port(), free_port()
            self.bus_ports.append(bus_port)
            node_dir = self.dir / f"node-{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            # The bus port's own free port (not PORT+10000, which may be taken or > 65535).
            args = [self.binary, "--port", str(port), "--bind", "127.0.0.1",
                    "--dir", str(node_dir), "--cluster-enabled", "yes",
                    "--cluster-port", str(bus_port), "--cluster-config-file", "nodes.conf",
                    "--save", "", "--appendonly", "no", "--daemonize", "no",
                    "--logfile", str(node_dir / "redis.log"), *self.extra]
            if self.password:
                args += ["--requirepass", self.password, "--masterauth", self.password]
            self._procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL))
            self.ports.append(port)
        self._wait(lambda c: c.ping(), "every node to answer PING")
        for i in range(self.masters):
            lo, hi = i * SLOTS // self.masters, (i + 1) * SLOTS // self.masters - 1
            c = self.client(i)
            c.execute_command("CLUSTER ADDSLOTSRANGE", lo, hi)
            if i:
                c.execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0], self.bus_ports[0])
        self._wait(self._ready, "cluster_state:ok and every node known to every node")
        return self

    def _ready(self, c: redis.Redis) -> bool:
        info = c.execute_command("CLUSTER INFO")  # parsed into a dict by redis-py
        return (str(info.get("cluster_state")) == "ok"
                and int(info.get("cluster_known_nodes", 0)) == self.masters)

    def _wait(self, check: object, what: str) -> None:
        deadline = time.monotonic() + READY_S
        while True:
            try:
                if all(check(self.client(i)) for i in range(self.masters)):  # type: ignore[operator]
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
