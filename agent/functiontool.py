"""Plain Python functions as tools (verl's ``@function_tool`` and ``function_tool_path``):
the decorator, the OpenAI schema built from a function's signature and docstring, and
:class:`FunctionTool`, the wrapper that gives a function the tool interface.

verl builds the schema with ``transformers.utils.get_json_schema`` (type hints plus a
Google-style docstring's ``Args:``) and then passes it through its pydantic schema, which
keeps of each parameter only ``type``, ``description`` and ``enum``. The prompt the model sees
is that final dict, so rlbus builds exactly it (same keys, same order) without importing
transformers: the same tools file renders the same tools block under either trainer.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import re
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from agent.tool import response_text

__all__ = ["FunctionTool", "function_return", "function_schema", "function_tool", "marked_tool"]

_TOOL_ATTR = "__rlbus_function_tool__"

_SCALAR_TYPES: dict[Any, str] = {
    bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
}
_CONTAINER_TYPES: dict[Any, str] = {list: "array", tuple: "array", dict: "object"}
_SECTION = re.compile(r"^\s*(Args|Returns|Raises):\s*$")
_ARG_LINE = re.compile(r"^(\w+)(?:\s*\([^()]*\))?:\s*(.*)$")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


class FunctionTool:
    """A function as a tool of verl's interface. It has no per-trajectory state (as verl's
    function tools: ``tools_kwargs`` do not reach it): ``create`` gives a fresh id,
    ``release`` does nothing. A sync function runs in a worker thread, so a slow one never
    holds the event loop that awaits it."""

    def __init__(self, fn: Callable[..., Any], name: str, tool_schema: dict[str, Any]) -> None:
        self.fn = fn
        self.name = name
        self.tool_schema = tool_schema
        self.is_async = inspect.iscoroutinefunction(fn)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or uuid.uuid4().hex

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[str, float | None, dict[str, Any]]:
        if self.is_async:
            returned = await self.fn(**parameters)
        else:
            returned = await asyncio.to_thread(self.fn, **parameters)
        return function_return(returned)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


def function_tool(name: str | Callable[..., Any] | None = None, *,
                  schema: Mapping[str, Any] | None = None) -> Any:
    """Mark a function as a tool: ``@function_tool`` (named after the function),
    ``@function_tool("other_name")`` or ``@function_tool(schema={...})`` (a hand-written
    OpenAI schema instead of the inferred one, named by its ``function.name`` unless a name
    is given). The function itself is returned unchanged;
    the schema is built here, so a function that cannot be described fails when its file
    loads, naming it."""
    def mark(fn: Callable[..., Any], tool_name: str | None) -> Callable[..., Any]:
        if schema is not None:
            built = json.loads(json.dumps(dict(schema)))  # a plain copy the caller cannot change
            function = built.setdefault("function", {})
            final_name = tool_name or function.get("name") or fn.__name__
            function["name"] = final_name
        else:
            final_name = tool_name or fn.__name__
            built = function_schema(fn, final_name)
        setattr(fn, _TOOL_ATTR, FunctionTool(fn, final_name, built))
        return fn

    if callable(name):
        return mark(name, None)
    return lambda fn: mark(fn, name)


def marked_tool(obj: Any) -> FunctionTool | None:
    """The tool ``@function_tool`` made of ``obj``, or None for anything else."""
    tool = getattr(obj, _TOOL_ATTR, None) if callable(obj) else None
    return tool if isinstance(tool, FunctionTool) else None


def function_return(returned: Any) -> tuple[str, float | None, dict[str, Any]]:
    """A function tool's return as ``(text, reward, metrics)``, read as verl reads it: a
    string; a dict (its JSON); a tuple ``(response,)``, ``(response, reward)`` or
    ``(response, reward, metrics)``; anything else rendered with ``str``. A tuple of another
    length is a TypeError (a tool bug, as verl says). No reward is None."""
    if not isinstance(returned, tuple):
        return _function_text(returned), None, {}
    if not 1 <= len(returned) <= 3:
        raise TypeError(f"a function tool returned a tuple of length {len(returned)}: "
                        "(response,), (response, reward) or (response, reward, metrics)")
    reward = None if len(returned) < 2 or returned[1] is None else float(returned[1])
    metrics = {} if len(returned) < 3 or returned[2] is None else dict(returned[2])
    return _function_text(returned[0]), reward, metrics


def _function_text(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if hasattr(value, "text"):  # verl's ToolResponse
        return response_text(value)
    return value if isinstance(value, str) else str(value)


# --------------------------------------------------------------------------- the schema


def function_schema(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    """The OpenAI tool schema of ``fn`` as verl renders it for the chat template: the
    docstring's description, one property per parameter (type from its hint, description
    from the docstring's ``Args:``, ``enum`` from a ``Literal``/``Enum`` hint or a trailing
    ``(choices: [...])``), ``required`` the parameters without a default. A TypeError names
    what cannot be described (no docstring, a parameter without a hint or a description,
    ``*args``/``**kwargs``, a type verl's schema has no ``type`` for)."""
    where = f"function tool {name!r} ({getattr(fn, '__qualname__', fn)!r})"
    signature = inspect.signature(fn)
    variadic = [p.name for p in signature.parameters.values()
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise TypeError(f"{where}: an OpenAI schema has no place for *args/**kwargs {variadic}")
    doc = inspect.getdoc(fn)
    if not doc:
        raise TypeError(f"{where}: needs a docstring (a description and an Args: section)")
    description, arg_docs = parse_docstring(doc)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    for param in signature.parameters.values():
        if param.name not in hints:
            raise TypeError(f"{where}: parameter {param.name!r} has no type hint")
        if param.name not in arg_docs:
            raise TypeError(f"{where}: the docstring's Args: does not describe {param.name!r}")
        properties[param.name] = _property(hints[param.name], arg_docs[param.name], where)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    required = [p.name for p in signature.parameters.values() if p.default is p.empty]
    if required:
        parameters["required"] = required
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": parameters}}


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """A Google-style docstring's description (the text before its first section) and its
    ``Args:`` entries (name -> description, continuation lines joined with spaces)."""
    lines = doc.strip().splitlines()
    sections = {i: match[1] for i, line in enumerate(lines) if (match := _SECTION.match(line))}
    description = "\n".join(lines[:min(sections, default=len(lines))]).strip()
    args_at = next((i for i, section in sections.items() if section == "Args"), None)
    if args_at is None:
        return description, {}
    end = next((i for i in sections if i > args_at), len(lines))
    return description, _arg_entries([line for line in lines[args_at + 1:end] if line.strip()])


def _arg_entries(lines: list[str]) -> dict[str, str]:
    if not lines:
        return {}
    indent = min(len(line) - len(line.lstrip()) for line in lines)
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        match = _ARG_LINE.match(line.strip()) if len(line) - len(line.lstrip()) == indent \
            else None
        if match:
            current = entries.setdefault(match[1], [])
            current.append(match[2])
        elif current is not None:
            current.append(line.strip())
    return {arg: " ".join(part for part in parts if part) for arg, parts in entries.items()}


def _property(hint: Any, doc: str, where: str) -> dict[str, Any]:
    """One parameter's schema, keyed in verl's order: type, description, enum."""
    json_type, values = _json_type(hint, where)
    choices = _CHOICES.search(doc)
    if choices:
        values = [c.strip() if isinstance(c, str) else c for c in json.loads(choices[1])]
        doc = doc[:choices.start()].strip()
    prop: dict[str, Any] = {"type": json_type, "description": doc}
    if values is not None:
        prop["enum"] = values
    return prop


def _json_type(hint: Any, where: str) -> tuple[str | list[str], list[Any] | None]:
    """The JSON type of a hint and its enum values (None: any value of the type)."""
    origin = typing.get_origin(hint)
    if origin is None and hint in _SCALAR_TYPES:
        return _SCALAR_TYPES[hint], None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_type([member.value for member in hint], where)
    if origin is typing.Literal:
        return _enum_type(list(typing.get_args(hint)), where)
    if origin is typing.Union or origin is types.UnionType:
        return _union_type(hint, where)
    container = _CONTAINER_TYPES.get(origin if origin is not None else hint)
    if container is None:
        raise TypeError(f"{where}: the type hint {hint!r} has no JSON schema type verl's tool "
                        "schema can hold (int, float, str, bool, list, tuple, dict, Literal, "
                        "Enum, and unions of them)")
    return container, None


def _enum_type(values: list[Any], where: str) -> tuple[str | list[str], list[Any]]:
    if not values or any(type(v) not in _SCALAR_TYPES for v in values):
        raise TypeError(f"{where}: enum values {values!r} must be JSON scalars, at least one")
    names = list(dict.fromkeys(_SCALAR_TYPES[type(v)] for v in values))
    return (names[0] if len(names) == 1 else names), values


def _union_type(hint: Any, where: str) -> tuple[str | list[str], list[Any] | None]:
    # As transformers: None makes the type nullable (a key verl's schema drops); one other
    # member is that member; several plain types are their sorted names.
    members = [_json_type(arg, where) for arg in typing.get_args(hint) if arg is not type(None)]
    if len(members) == 1:
        return members[0]
    if any(values is not None or isinstance(t, list) for t, values in members):
        raise TypeError(f"{where}: the union {hint!r} needs anyOf, which verl's tool schema "
                        "cannot hold")
    names = sorted({t for t, _ in members if isinstance(t, str)})
    return (names[0] if len(names) == 1 else names), None
