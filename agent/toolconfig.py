"""The run's tools, loaded as verl configures them: ``multi_turn.tool_config_path`` (a YAML
``tools:`` list of ``{class_name, config, tool_schema}``) and ``multi_turn.function_tool_path``
(a Python file of ``@function_tool`` functions).

A ``class_name`` is found, in this order:

* rlbus's built-in tools, also under the names verl users write for the same tool
  (:data:`BUILTIN_TOOLS`): a verl YAML runs here unchanged;
* ``path/to/file.py:ClassName``: a class from a file (relative to the YAML's folder first,
  then the working directory), loaded the way rlbus loads a reward file;
* ``pkg.module.ClassName``: importable on ``sys.path``.

rlbus runs verl's tool interface without verl installed, so a tool file that imports verl
cannot load; the error says so and names the file and line. Every failure is a
:class:`ToolConfigError` naming the file and the entry, which the run's config loader turns
into exit 2 on :attr:`ToolConfigError.key`.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from agent.functiontool import FunctionTool, marked_tool
from agent.tool import Tool, schema_name

__all__ = [
    "BUILTIN_TOOLS",
    "FUNCTION_TOOL_KEY",
    "TOOL_CONFIG_KEY",
    "ToolConfigError",
    "builtin_class_path",
    "check_unique_names",
    "load_function_tools",
    "load_tool_config",
    "plain_schema",
    "resolve_tool_class",
    "tool_name",
]

TOOL_CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
FUNCTION_TOOL_KEY = "actor_rollout_ref.rollout.multi_turn.function_tool_path"

# verl YAMLs name verl's own tool classes, which cannot load here (they import verl): each is
# mapped to the rlbus tool that does the same job, and rlbus's tools answer to their own names.
BUILTIN_TOOLS: dict[str, str] = {
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "agent.sandbox.CodeInterpreterTool",
    "agent.sandbox.CodeInterpreterTool": "agent.sandbox.CodeInterpreterTool",
    "agent.calculator.CalculatorTool": "agent.calculator.CalculatorTool",
}
# Recipes subclass verl's sandbox tool (ReTool's recipe.retool.retool.CustomSandboxFusionTool):
# any class so named is a code interpreter too.
_SANDBOX_FUSION_SUFFIX = "SandboxFusionTool"
_CODE_INTERPRETER = "agent.sandbox.CodeInterpreterTool"

# verl's pydantic tool schema keeps these keys, in this order, of each level (its
# model_dump(exclude_unset=True, exclude_none=True)); the chat template renders that.
_TOOL_KEYS = ("type", "function")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_PARAMETERS_KEYS = ("type", "properties", "required")
_PROPERTY_KEYS = ("type", "description", "enum")
_SCHEMA_FIELDS = frozenset(_TOOL_KEYS + _FUNCTION_KEYS + _PARAMETERS_KEYS + _PROPERTY_KEYS)
"""Every field of verl's schema models (an unset one reads as None, as there)."""


class ToolConfigError(ValueError):
    """A tool configuration that cannot load: ``path`` (the YAML or Python file) and why
    (``message`` names the entry: its index and class_name). ``key`` is the config key
    that named the file."""

    def __init__(self, path: str | Path, message: str, key: str = TOOL_CONFIG_KEY) -> None:
        self.path = str(path)
        self.message = message
        self.key = key
        super().__init__(f"{path}: {message}")


class _Problem(Exception):
    """Why one class or file could not load; the caller adds which file and entry."""


# --------------------------------------------------------------------------- tool_config_path


def load_tool_config(path: str | Path) -> list[Tool]:
    """The tools of a verl tool config YAML, constructed ``Cls(config=..., tool_schema=...)``
    in the file's order; their function names are unique."""
    file = Path(path).expanduser()
    entries = _tool_entries(file)
    tools = [_load_entry(file, index, entry) for index, entry in enumerate(entries)]
    try:
        check_unique_names(tools)
    except ValueError as exc:
        raise ToolConfigError(file, str(exc)) from None
    return tools


def _tool_entries(file: Path) -> list[Any]:
    try:
        doc = yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ToolConfigError(file, f"cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ToolConfigError(file, f"not valid YAML: {exc}") from None
    if not isinstance(doc, dict) or "tools" not in doc:
        raise ToolConfigError(file, "needs a top-level 'tools:' list (verl's tool config "
                                    "layout: tools: [{class_name, config, tool_schema}])")
    entries = doc["tools"] or []
    if not isinstance(entries, list):
        raise ToolConfigError(file, f"'tools' is a {type(entries).__name__}, not a list")
    return entries


def _load_entry(file: Path, index: int, entry: Any) -> Tool:
    class_name = entry.get("class_name") if isinstance(entry, dict) else None
    if not isinstance(class_name, str) or not class_name.strip():
        raise ToolConfigError(file, f"tools[{index}]: needs a class_name")
    where = f"tools[{index}] ({class_name})"
    try:
        config, schema = _entry_arguments(entry)
        cls = resolve_tool_class(class_name, file.parent)
    except _Problem as exc:
        raise ToolConfigError(file, f"{where}: {exc}") from None
    try:
        tool = cls(config=config, tool_schema=None if schema is None else ToolSchema(schema))
        tool_name(tool)
    except Exception as exc:
        raise ToolConfigError(file, f"{where}: constructing it raised {type(exc).__name__}: "
                                    f"{exc}") from None
    return tool


def _entry_arguments(entry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """An entry's ``config`` (a dict; verl's ``type: native`` is the only kind) and its
    ``tool_schema`` as a plain dict (None: the tool's own)."""
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise _Problem(f"config is a {type(config).__name__}, not a mapping")
    if config.get("type", "native") != "native":
        raise _Problem(f"config.type {config['type']!r}: only 'native' tools exist (as verl)")
    schema = entry.get("tool_schema")
    if schema is None:
        return config, None
    if not isinstance(schema, dict):
        raise _Problem(f"tool_schema is a {type(schema).__name__}, not a mapping")
    try:
        return config, plain_schema(schema)
    except ValueError as exc:
        raise _Problem(f"tool_schema: {exc}") from None


class ToolSchema(dict[str, Any]):
    """A tool's schema as a tool is constructed with it: a plain dict that also reads as
    verl's pydantic schema does (``tool_schema.function.name``, ``model_dump()``), so that a
    tool written for verl's ``BaseTool`` finds what it expects."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            if name in _SCHEMA_FIELDS:
                return None  # a field verl's model has, unset here
            raise AttributeError(name) from None
        return ToolSchema(value) if isinstance(value, dict) else value

    def model_dump(self, **_options: Any) -> dict[str, Any]:
        """A plain copy (None values are already out: verl's ``exclude_none``)."""
        return copy.deepcopy(dict(self))


def plain_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI tool schema as verl hands it to the chat template: the keys verl's schema
    model has, in its order, None values dropped (its ``model_dump(exclude_unset=True,
    exclude_none=True)``). A ValueError when there is no ``function.name``."""
    tool = _kept(schema, _TOOL_KEYS)
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ValueError("needs a 'function' mapping (OpenAI's function tool layout)")
    function = tool["function"] = _kept(function, _FUNCTION_KEYS)
    schema_name(tool)
    parameters = function.get("parameters")
    if parameters is None:
        return tool
    if not isinstance(parameters, Mapping):
        raise ValueError("function.parameters is not a mapping")
    parameters = function["parameters"] = _kept(parameters, _PARAMETERS_KEYS)
    properties = parameters.get("properties")
    if properties is not None:
        if not isinstance(properties, Mapping) or \
                not all(isinstance(p, Mapping) for p in properties.values()):
            raise ValueError("function.parameters.properties is not a mapping of mappings")
        parameters["properties"] = {name: _kept(p, _PROPERTY_KEYS)
                                    for name, p in properties.items()}
    return tool


def _kept(mapping: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    return {key: copy.deepcopy(mapping[key]) for key in keys if mapping.get(key) is not None}


def tool_name(tool: Any) -> str:
    """A tool's function name: its ``name``, else its schema's ``function.name``."""
    name = getattr(tool, "name", None)
    if isinstance(name, str) and name:
        return name
    return schema_name(getattr(tool, "tool_schema", None))


def check_unique_names(tools: Iterable[Any]) -> None:
    """A ValueError naming every function name two tools share (the model calls by name)."""
    seen: set[str] = set()
    duplicates: list[str] = []
    for tool in tools:
        name = tool_name(tool)
        if name in seen and name not in duplicates:
            duplicates.append(name)
        seen.add(name)
    if duplicates:
        raise ValueError(f"tool names {duplicates} are used by more than one tool: each tool's "
                         "function name must be unique across tool_config_path and "
                         "function_tool_path")


# --------------------------------------------------------------------------- classes


def builtin_class_path(class_name: str) -> str | None:
    """The rlbus tool (a dotted class path) that ``class_name`` names, or None."""
    builtin = BUILTIN_TOOLS.get(class_name)
    if builtin is None and class_name.rpartition(".")[2].endswith(_SANDBOX_FUSION_SUFFIX):
        return _CODE_INTERPRETER
    return builtin


def resolve_tool_class(class_name: str, base_dir: str | Path = ".") -> Any:
    """The class ``class_name`` names: a built-in (:func:`builtin_class_path`),
    ``file.py:Class`` (relative to ``base_dir``, then the working directory) or
    ``pkg.module.Class``. Raises :class:`_Problem` saying why not."""
    builtin = builtin_class_path(class_name)
    if builtin is not None:
        return _dotted_class(builtin)
    if ":" in class_name:
        file_part, _, attr = class_name.rpartition(":")
        module = _import_file(_find_file(file_part, Path(base_dir)))
        return _class_of(module, attr, file_part)
    return _dotted_class(class_name)


def _dotted_class(dotted: str) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise _Problem("class_name is neither pkg.module.Class nor path/to/file.py:Class")
    if module_name.split(".")[0] == "verl":
        raise _Problem(f"{module_name} is verl's own module, and rlbus runs without verl: "
                       f"its built-in tools are {sorted(set(BUILTIN_TOOLS))}; another tool "
                       "goes in a file of its own (path/to/file.py:Class)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if _is_verl(exc):
            raise _Problem(_verl_message(exc, module_name)) from None
        raise _Problem(f"cannot import {module_name!r}: {exc}") from None
    except Exception as exc:
        raise _Problem(f"importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    return _class_of(module, attr, module_name)


def _class_of(module: Any, attr: str, source: str) -> Any:
    cls = getattr(module, attr, None)
    if cls is None:
        raise _Problem(f"{source} has no {attr!r}")
    if not callable(cls):
        raise _Problem(f"{source}: {attr!r} is a {type(cls).__name__}, not a class")
    return cls


def _find_file(file_part: str, base_dir: Path) -> Path:
    file = Path(file_part).expanduser()
    candidates = [file] if file.is_absolute() else [base_dir / file, Path.cwd() / file]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise _Problem(f"no such file {file_part!r} (looked for {[str(c) for c in candidates]})")


def _import_file(file: Path) -> Any:
    """The module of a Python file, imported once per process: entries naming classes of
    one file share its module (and so its classes)."""
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:16]
    module_name = f"rlbus_tool_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise _Problem(f"{file}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # In sys.modules while it runs: dataclasses and pickling in the file look themselves up.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise _Problem(_import_failure(file, exc)) from None
    return module


def _import_failure(file: Path, exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError) and _is_verl(exc):
        return _verl_message(exc, str(file))
    if isinstance(exc, SyntaxError):
        return f"{file}: syntax error at line {exc.lineno}: {exc.msg}"
    return f"{file}: importing it raised {type(exc).__name__}: {exc}"


def _is_verl(exc: ModuleNotFoundError) -> bool:
    return (exc.name or "").split(".")[0] == "verl"


def _verl_message(exc: ModuleNotFoundError, source: str) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen")]
    at = f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else source
    return (f"{source} imports verl ({exc.name!r} at {at}): rlbus runs verl's tool interface "
            "(async create/execute/calc_reward/release, constructed (config, tool_schema)) "
            "without verl installed, so a tool's file must not import verl. Drop the verl "
            "imports: a tool needs no base class, execute may return plain text, and "
            "@function_tool is agent.toolbox.function_tool")


# --------------------------------------------------------------------------- function_tool_path


def load_function_tools(path: str | Path) -> list[Tool]:
    """The ``@function_tool`` functions of a Python file (verl's ``function_tool_path``; the
    decorator is :func:`agent.toolbox.function_tool`), in the file's order, as tools. A file
    with none is an error: the run would otherwise go on without the tools it was given."""
    try:
        module = _import_file(_find_file(str(path), Path.cwd()))
    except _Problem as exc:
        raise ToolConfigError(path, str(exc), FUNCTION_TOOL_KEY) from None
    tools: dict[int, FunctionTool] = {}
    for value in vars(module).values():
        tool = marked_tool(value)
        if tool is not None:
            tools.setdefault(id(tool), tool)
    if not tools:
        raise ToolConfigError(path, "has no @function_tool functions (decorate them with "
                                    "agent.toolbox.function_tool)", FUNCTION_TOOL_KEY)
    try:
        check_unique_names(tools.values())
    except ValueError as exc:
        raise ToolConfigError(path, str(exc), FUNCTION_TOOL_KEY) from None
    return list(tools.values())
