"""Group-level calls (:class:`GroupCommands`, part of :class:`~bus.streams.Bus`): the
consumer groups of a stream and their members, who holds which pending entry, and the end of
a group; and :func:`in_group`, which turns Redis' NOGROUP error into a named one."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import NamedTuple, TypeVar

from redis.exceptions import ResponseError

from bus.client import BusClient, Reply
from bus.entries import to_text
from bus.errors import BusError, GroupGone, StreamGone

__all__ = ["GroupCommands", "GroupInfo", "in_group", "member_names"]

T = TypeVar("T")


class GroupInfo(NamedTuple):
    """One consumer group of a stream (XINFO GROUPS)."""

    name: str
    consumers: int
    pending: int
    last_delivered_id: str


async def in_group(bus: BusClient, stream: str, group: str, reply: Awaitable[T]) -> T:
    """``await reply`` (a call on ``group`` of ``stream``), with Redis' NOGROUP error turned
    into :class:`~bus.errors.StreamGone` or :class:`~bus.errors.GroupGone` (EXISTS tells
    which)."""
    try:
        return await reply
    except ResponseError as exc:
        if not str(exc).startswith("NOGROUP"):
            raise
        gone: BusError = (GroupGone(stream, group) if await bus.command("EXISTS", stream)
                          else StreamGone(stream, group))
        raise gone from exc


def _fields(row: list[Reply]) -> dict[bytes, Reply]:
    """One XINFO reply row (a flat ``name, value, ...`` list) as a dict."""
    return dict(zip(row[::2], row[1::2], strict=False))


async def member_names(bus: BusClient, stream: str, group: str) -> list[str]:
    """Names of the members of ``group`` ([] when the stream or group is missing).
    Wraps XINFO CONSUMERS."""
    try:
        raw = await bus.command("XINFO", "CONSUMERS", stream, group)
    except ResponseError as exc:
        if "no such key" in str(exc).lower() or str(exc).startswith("NOGROUP"):
            return []
        raise
    return [to_text(_fields(row)[b"name"]) for row in raw]


class GroupCommands(BusClient):
    """Group-level calls: XINFO GROUPS / CONSUMERS, XPENDING owners, XGROUP DESTROY."""

    async def groups(self, stream: str) -> list[GroupInfo]:
        """The consumer groups of ``stream`` ([] when the stream does not exist).
        Wraps XINFO GROUPS."""
        try:
            raw = await self.command("XINFO", "GROUPS", stream)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return []
            raise
        return [
            GroupInfo(
                name=to_text(g[b"name"]),
                consumers=int(g[b"consumers"]),
                pending=int(g[b"pending"]),
                last_delivered_id=to_text(g[b"last-delivered-id"]),
            )
            for g in map(_fields, raw)
        ]

    async def consumers(self, stream: str, group: str) -> list[str]:
        """Names of the members of ``group`` ([] when the stream or group is missing).
        Wraps XINFO CONSUMERS."""
        return await member_names(self, stream, group)

    async def pending_owners(self, stream: str, group: str, count: int) -> dict[str, str]:
        """Who holds each of the (up to ``count``) oldest entries pending in ``group``:
        ``{entry id: consumer name}``. Wraps XPENDING stream group - + count. A missing
        stream or group raises :class:`~bus.errors.StreamGone` /
        :class:`~bus.errors.GroupGone`."""
        rows = await in_group(
            self, stream, group, self.command("XPENDING", stream, group, "-", "+", count)
        )
        return {row[0].decode(): row[1].decode() for row in rows or []}

    async def destroy_group(self, stream: str, group: str) -> bool:
        """Delete a consumer group; True if it existed. Wraps XGROUP DESTROY."""
        try:
            n = await self.command("XGROUP", "DESTROY", stream, group)
        except ResponseError as exc:
            if "requires the key to exist" in str(exc):
                return False
            raise
        return bool(n)
