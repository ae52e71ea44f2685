"""Plain keys: small text values, existence, deletion, pattern scans.

For the few things a run keeps beside its streams (an archive's path, a reader's note) and
for tools that list or remove a run's keys.
"""

from __future__ import annotations

from bus.client import BusClient
from bus.entries import to_text

__all__ = ["KeyCommands"]


class KeyCommands(BusClient):
    """GET/SET of text, EXISTS, DEL, SCAN."""

    async def set_text(self, key: str, value: str) -> None:
        """Store a small text value (a path, a note). Wraps SET."""
        await self.command("SET", key, value)

    async def get_text(self, key: str) -> str | None:
        """The text at ``key`` (None when missing). Wraps GET."""
        raw = await self.command("GET", key)
        return None if raw is None else to_text(raw)

    async def exists(self, key: str) -> bool:
        """Whether ``key`` exists. Wraps EXISTS."""
        return bool(await self.command("EXISTS", key))

    async def delete(self, *keys: str) -> int:
        """Delete keys (streams, blob chunks); returns how many existed. Wraps DEL."""
        if not keys:
            return 0
        return int(await self.command("DEL", *keys))

    async def scan(self, pattern: str) -> list[str]:
        """Every key matching ``pattern``, sorted. Wraps SCAN MATCH (cursor loop; each
        page is its own call of the retry policy: a SCAN cursor is stateless, so it
        survives a reconnect)."""
        keys: set[bytes] = set()
        cursor: int | bytes = 0
        while True:
            cursor, batch = await self.command("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
            keys.update(batch)
            if int(cursor) == 0:
                return sorted(to_text(k) for k in keys)
