"""Publishing: appending encoded messages to streams (XADD).

Each entry holds one message under :data:`runschema.messages.FIELD`. Several messages go in one
round trip (pipelined XADDs), in MULTI/EXEC when they must land together.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from bus.client import Arg, BusClient
from runschema.messages import FIELD, Message, encode

__all__ = ["PublishCommands", "xadd_args"]


def xadd_args(stream: str, data: bytes, maxlen: int | None = None) -> tuple[Arg, ...]:
    """The XADD command appending ``data`` (one encoded message) to ``stream``."""
    if maxlen is None:
        return ("XADD", stream, "*", FIELD, data)
    # "~" lets Redis trim whole macro nodes: far cheaper than exact trimming.
    return ("XADD", stream, "MAXLEN", "~", maxlen, "*", FIELD, data)


class PublishCommands(BusClient):
    """XADD of messages (and of raw fields, for tools and tests)."""

    async def publish(self, stream: str, msg: Message, *, maxlen: int | None = None) -> str:
        """Append one message; returns its entry id. Wraps XADD.

        ``maxlen`` trims approximately (``MAXLEN ~``) and may drop unconsumed entries: use it
        only for streams no group depends on (e.g. heartbeats); see
        :meth:`~bus.trim.TrimCommands.trim_safely`.
        """
        entry_id: bytes = await self.command(*xadd_args(stream, encode(msg), maxlen))
        return entry_id.decode()

    async def publish_many(
        self,
        stream: str,
        msgs: Iterable[Message],
        *,
        atomic: bool = False,
        maxlen: int | None = None,
    ) -> list[str]:
        """Append many messages in one round trip (pipelined XADDs).

        ``atomic=True`` wraps them in MULTI/EXEC so they land together or not at all (a group
        of samples of one ticket).
        """
        return await self.publish_multi([(stream, m) for m in msgs], atomic=atomic, maxlen=maxlen)

    async def publish_multi(
        self,
        items: Iterable[tuple[str, Message]],
        *,
        atomic: bool = True,
        maxlen: int | None = None,
    ) -> list[str]:
        """Append ``(stream, msg)`` pairs, possibly to several streams, in one round trip.

        Wraps pipelined XADDs, in MULTI/EXEC when ``atomic`` (the default here: use it to
        publish e.g. samples and the event announcing them together; the streams must live in
        one hash slot on a cluster, which a run's keys do).
        """
        commands = [xadd_args(s, encode(m), maxlen) for s, m in items]
        ids = await self.pipeline(commands, atomic=atomic, op="XADD")
        return [i.decode() for i in ids]

    async def publish_raw(self, stream: str, fields: Mapping[str | bytes, Arg]) -> str:
        """Append an entry with arbitrary fields (tools and tests; bypasses encoding).
        Wraps XADD."""
        args: list[Arg] = ["XADD", stream, "*"]
        for k, v in fields.items():
            args += [k, v]
        entry_id: bytes = await self.command(*args)
        return entry_id.decode()
