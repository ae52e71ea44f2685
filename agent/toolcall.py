"""Tool calls parsed from an assistant turn's text, as verl's agent loop parses them
(``multi_turn.format``; only ``hermes``, the Qwen/Hermes layout, for now).

verl's hermes parser keeps a call whose block is a JSON object with a ``name`` and an
``arguments``, and logs and drops any other block; the turn's content is the text with every
block removed. rlbus parses the same way, and also says how many blocks it dropped
(:attr:`ParsedTurn.malformed`): a model that writes broken calls is something the rollouter
counts, not just a log line.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

import msgspec

__all__ = ["FORMATS", "ParsedTurn", "ToolCall", "parse_tool_calls"]

FORMATS = ("hermes",)
"""The tool call formats :func:`parse_tool_calls` reads (verl's ``multi_turn.format``)."""

_HERMES_START = "<tool_call>"
_HERMES_END = "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolCall(msgspec.Struct, frozen=True):
    """One call the model wrote: the function's ``name`` and its ``arguments`` as JSON text
    (the model's value re-dumped with ``ensure_ascii=False``, as verl's parser does; the
    toolbox decodes it and refuses anything but an object)."""

    name: str
    arguments: str


class ParsedTurn(NamedTuple):
    """An assistant turn read for tool calls: ``content`` is the text without the call blocks,
    ``calls`` the well-formed calls in order, ``malformed`` how many complete blocks were
    dropped (not JSON, not an object, no string ``name`` or no ``arguments``)."""

    content: str
    calls: list[ToolCall]
    malformed: int = 0


def parse_tool_calls(text: str, fmt: str = "hermes") -> ParsedTurn:
    """The tool calls of ``text`` in the format ``fmt`` (one of :data:`FORMATS`; another is a
    ValueError naming it). Unpack as ``content, calls, malformed``."""
    if fmt != "hermes":
        raise ValueError(f"tool call format {fmt!r} is not supported: one of {list(FORMATS)} "
                         "(multi_turn.format)")
    return _parse_hermes(text)


def _parse_hermes(text: str) -> ParsedTurn:
    # As verl: without both markers the text is all content, untouched.
    if _HERMES_START not in text or _HERMES_END not in text:
        return ParsedTurn(text, [])
    calls: list[ToolCall] = []
    malformed = 0
    for block in _HERMES_BLOCK.findall(text):
        call = _hermes_call(block)
        if call is None:
            malformed += 1
        else:
            calls.append(call)
    return ParsedTurn(_HERMES_BLOCK.sub("", text), calls, malformed)


def _hermes_call(block: str) -> ToolCall | None:
    """The call one block holds, or None where verl's parser would drop it."""
    try:
        value = json.loads(block)
    except (ValueError, RecursionError):  # not JSON, or nested past the decoder's depth
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
            or "arguments" not in value:
        return None
    return ToolCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False))
