"""Same-slot pipelines on a Redis Cluster, sent to the master that owns the slot.

redis-py's cluster pipeline queues each command of a MULTI/EXEC through a private event loop
in a worker thread (its slot is resolved by a coroutine behind a synchronous call): about
0.4 ms and a thread per command, with the caller's loop blocked meanwhile, where a plain
pipeline costs microseconds. Every pipeline of the bus holds the keys of one run, one slot
(``{RUN}``), so :class:`SlotPipelines` sends it as a plain pipeline (one round trip,
MULTI/EXEC when atomic) on a plain client of the slot's master, one client per master,
with the cluster client's connection settings (user, password, TLS, client name).

A slot that moved (resharding, failover) answers MOVED: the slot table is read again and
the pipeline is sent once more, to the new owner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import MovedError, ResponseError

if TYPE_CHECKING:  # bus.client builds on this module
    from bus.client import Arg, Reply

__all__ = ["SlotPipelines"]


class SlotPipelines:
    """Plain clients of a cluster's masters, for pipelines whose keys share one slot."""

    def __init__(self, cluster: RedisCluster, prepare: Callable[[aioredis.Redis], None]) -> None:
        self._cluster = cluster
        self._prepare = prepare  # the bus's response callbacks, as on the cluster client
        self._clients: dict[str, aioredis.Redis] = {}

    async def slot_of(self, commands: Sequence[Sequence[Arg]]) -> int | None:
        """The one slot all ``commands`` use, or None when they use several (or none)."""
        slots = {await self._cluster._determine_slot(str(args[0]), *args[1:])
                 for args in commands}
        return slots.pop() if len(slots) == 1 else None

    def _client(self, node: ClusterNode) -> aioredis.Redis:
        client = self._clients.get(node.name)
        if client is None:
            pool = aioredis.ConnectionPool(connection_class=node.connection_class,
                                           max_connections=node.max_connections,
                                           **node.connection_kwargs)
            client = self._clients[node.name] = aioredis.Redis.from_pool(pool)  # owns it
            self._prepare(client)
        return client

    async def execute(self, slot: int, commands: Sequence[Sequence[Arg]],
                      atomic: bool) -> list[Reply]:
        """Run ``commands`` (all in ``slot``) in one round trip on the slot's master (MULTI/
        EXEC when ``atomic``); on MOVED, once more after reading the slot table again."""
        try:
            return await self._send(slot, commands, atomic)
        except (MovedError, ResponseError) as exc:
            if not _moved(exc):
                raise
        await self._cluster.nodes_manager.initialize()
        return await self._send(slot, commands, atomic)

    async def _send(self, slot: int, commands: Sequence[Sequence[Arg]],
                    atomic: bool) -> list[Reply]:
        node = self._cluster.nodes_manager.get_node_from_slot(slot)
        pipe = self._client(node).pipeline(transaction=atomic)
        for args in commands:
            pipe.execute_command(*args)
        return list(await pipe.execute())

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


def _moved(exc: BaseException) -> bool:
    # Inside MULTI a MOVED reply aborts the transaction: EXECABORT, naming MOVED.
    return isinstance(exc, MovedError) or "MOVED" in str(exc)
