"""The tool interface: verl's ``BaseTool`` shape (``create``, ``execute``, ``calc_reward``,
``release``, all async), so a tool written for verl's agent loop runs here unchanged as long
as it does not import verl itself; and :class:`ToolOutput`, what one call gave the
conversation.

A tool's ``execute`` returns ``(response, reward, metrics)`` as verl's does: ``response`` is
text or anything with a ``text`` attribute (verl's ``ToolResponse``), ``reward`` a number or
None, ``metrics`` a dict. The toolbox (:mod:`agent.toolbox`) turns whatever it returns, raises
or fails to return in time into a :class:`ToolOutput`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = ["Tool", "ToolOutput", "response_text", "schema_name"]


class ToolOutput(NamedTuple):
    """One tool call's outcome as the conversation sees it: ``text`` goes into the tool turn
    (truncated as ``multi_turn.max_tool_response_length`` says); ``reward`` is the step reward
    ``execute`` returned (None: none); ``failed``: the call did not run to a result (unknown
    tool, arguments that are not a JSON object, the tool raised or ran past its time), and
    ``text`` then says why, as verl's agent loop tells the model; ``seconds``: its wall time."""

    text: str
    reward: float | None = None
    metrics: dict[str, float] = {}
    failed: bool = False
    seconds: float = 0.0


@runtime_checkable
class Tool(Protocol):
    """A tool of verl's interface. ``name`` is its function's name (the schema's
    ``function.name``); ``tool_schema`` its OpenAI function schema as a plain dict
    (``{"type": "function", "function": {"name", "description", "parameters"}}``), which goes
    into the chat template's ``tools=``."""

    name: str
    tool_schema: Any

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any:
        """A new instance for one trajectory: its id, or ``(id, response)`` as verl's."""
        ...

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> Any:
        """Run the call: ``(response, reward, metrics)`` (verl's), or just the response."""
        ...

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's reward (verl's; the tool agent loop does not call it)."""
        ...

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free the instance."""
        ...


def response_text(response: Any) -> str:
    """The text of what a tool returned: a string, or verl's ``ToolResponse`` (its ``text``),
    or anything else rendered with ``str``; None is empty."""
    if response is None:
        return ""
    if isinstance(response, str):
        return response
    text = getattr(response, "text", None)
    if isinstance(text, str) or (text is None and hasattr(response, "text")):
        return text or ""
    return str(response)


def schema_name(schema: Any) -> str:
    """The function name of an OpenAI tool schema given as a dict (``function.name``) or as an
    object with ``function.name`` (verl's pydantic schema)."""
    function = schema.get("function") if isinstance(schema, dict) else getattr(schema, "function",
                                                                               None)
    name = function.get("name") if isinstance(function, dict) else getattr(function, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError("a tool schema needs function.name (OpenAI's function tool layout)")
    return name
