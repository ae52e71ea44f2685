"""Stream entries as the bus modules see them: ids, raw fields, decoded entries.

Every stream entry has a single field :data:`runschema.messages.FIELD` holding one encoded
message. Entry ids are ``str`` (``"1700000000000-0"``) in every public API; raw replies
(bytes) are turned into them here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from runschema.messages import FIELD, DecodeError, Message, decode

__all__ = [
    "BadEntry",
    "Entry",
    "decode_fields",
    "entry_key",
    "is_entry_id",
    "raw_of",
    "split_fields",
    "to_text",
]

log = logging.getLogger(__name__)

_ENTRY_ID = re.compile(r"^\d+(-\d+)?$")


class Entry(NamedTuple):
    """One decoded stream entry."""

    id: str
    msg: Message


class BadEntry(NamedTuple):
    """An entry that could not be decoded (log reads report these to ``on_bad``)."""

    stream: str
    id: str
    reason: str
    raw: bytes


def entry_key(entry_id: str | bytes) -> tuple[int, int]:
    """An entry id as ``(ms, seq)``, so ids compare in stream order."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def is_entry_id(text: str) -> bool:
    """Whether ``text`` is an explicit entry id (``ms`` or ``ms-seq``)."""
    return _ENTRY_ID.match(text) is not None


def to_text(value: object) -> str:
    """A reply value (bytes, or already text/number) as ``str``."""
    return value.decode() if isinstance(value, bytes) else str(value)


def split_fields(fields: list[bytes] | None) -> bytes | None:
    """The FIELD value of a raw RESP2 field list (None when absent)."""
    if fields is None:
        return None
    # Fast path: our entries have exactly one field.
    if len(fields) == 2 and fields[0] == FIELD:
        return fields[1]
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == FIELD:
            return fields[i + 1]
    return None


def raw_of(fields: list[bytes] | None) -> bytes:
    """Bytes to keep in a DeadLetter: the FIELD value, else all fields msgpack-encoded."""
    value = split_fields(fields)
    if value is not None:
        return bytes(value)
    if not fields:
        return b""
    return msgspec.msgpack.encode(list(fields))


def decode_fields(
    stream: str,
    entry_id: bytes,
    fields: list[bytes] | None,
    on_bad: Callable[[BadEntry], None] | None,
) -> Entry | None:
    """A raw log entry decoded; None for a bad one, which is logged at WARNING and passed to
    ``on_bad`` (log readers skip garbage, they never crash on it)."""
    try:
        return Entry(entry_id.decode(), decode(split_fields(fields)))
    except DecodeError as exc:
        bad = BadEntry(stream, entry_id.decode(), exc.reason, raw_of(fields))
        log.warning("skipping bad entry %s of %s: %s", bad.id, stream, bad.reason)
        if on_bad is not None:
            on_bad(bad)
        return None
