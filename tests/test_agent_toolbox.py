"""agent.toolbox: tool calls run off the caller's event loop on the box's own threads, each
bounded in time and answered as verl's tool agent loop answers (unknown tool, bad arguments,
a raise, a timeout); tools loaded from verl's tool config YAML and function tool files."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest

from agent.tool import ToolOutput
from agent.toolbox import (
    ToolBox,
    ToolConfigError,
    function_tool,
    load_function_tools,
    load_tool_config,
    schema_dict,
    truncate,
)
from agent.toolcall import ToolCall
from agent.toolconfig import FUNCTION_TOOL_KEY, builtin_class_path


def _schema(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                             "parameters": {"type": "object", "properties": {}}}}


class EchoTool:
    """Returns its ``text`` argument; records what create got."""

    def __init__(self, config: dict, tool_schema: dict | None) -> None:
        self.config = config
        self.tool_schema = tool_schema or _schema("echo")
        self.name = self.tool_schema["function"]["name"]
        self.created: list[dict] = []
        self.released: list[str] = []

    async def create(self, instance_id=None, **kwargs):
        self.created.append(kwargs)
        return f"id-{len(self.created)}", None

    async def execute(self, instance_id, parameters, **kwargs):
        return parameters.get("text", ""), parameters.get("reward"), {"n": 1, "label": "x"}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


class SleepTool(EchoTool):
    """Blocks its thread (time.sleep inside async def), as careless tools do."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config or {}, tool_schema or _schema("sleep"))

    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(parameters["seconds"])  # noqa: ASYNC251 (the blocking tool under test)
        return "slept"


class HangTool(EchoTool):
    """Blocks its thread until ``gate`` opens (bounded, so a failed test cannot hang)."""

    def __init__(self, gate: threading.Event):
        super().__init__({}, _schema("hang"))
        self.gate = gate

    async def execute(self, instance_id, parameters, **kwargs):
        self.gate.wait(10)
        return "finally"


class BoomTool(EchoTool):
    def __init__(self):
        super().__init__({}, _schema("boom"))

    async def create(self, instance_id=None, **kwargs):
        return "bare-id"  # a bare id, not verl's (id, response)

    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("kaput")


@pytest.fixture
def boxes():
    made: list[ToolBox] = []

    def make(tools, **kw):
        kw.setdefault("timeout_s", 10.0)
        box = ToolBox(tools, **kw)
        made.append(box)
        return box

    yield make
    for box in made:
        box.close()


# --------------------------------------------------------------------------- off the loop


@pytest.mark.asyncio
async def test_a_blocking_tool_blocks_neither_the_caller_nor_another_call(boxes):
    box = boxes([SleepTool(), EchoTool({}, None)], threads=2)
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            await asyncio.sleep(0.05)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    sleeping = asyncio.create_task(box.call(ToolCall("sleep", '{"seconds": 2}')))
    await asyncio.sleep(0.1)
    echoed = await box.call(ToolCall("echo", '{"text": "hi"}'))
    assert not sleeping.done()  # the echo came back while the other thread slept
    assert echoed.text == "hi" and not echoed.failed
    slept = await sleeping
    stop.set()
    await ticking
    assert slept == ToolOutput("slept", seconds=slept.seconds)
    assert slept.seconds >= 2.0
    assert ticks >= 10  # ~40 at 50 ms while the tool slept 2 s on its thread


@pytest.mark.asyncio
async def test_a_hung_tool_times_out_and_the_box_still_serves(boxes):
    gate = threading.Event()
    echo = EchoTool({}, None)
    box = boxes([HangTool(gate), echo], threads=2, timeout_s=0.3)
    try:
        hung = await box.call(ToolCall("hang", "{}"))
        assert hung.failed and hung.text == "Tool 'hang' timed out after 0.3 s"
        assert 0.3 <= hung.seconds < 5
        # The hung thread still counts as busy: this call goes to the other one.
        served = await box.call(ToolCall("echo", '{"text": "ok"}'))
        assert served.text == "ok" and not served.failed
        assert (box.calls, box.failures, box.timeouts) == (2, 1, 1)
    finally:
        gate.set()


@pytest.mark.asyncio
async def test_failures_read_as_verl_says_them(boxes):
    boom = BoomTool()
    box = boxes([EchoTool({}, None), boom])
    unknown, bad_json, not_object, raised = await asyncio.gather(
        box.call(ToolCall("nope", "{}")),
        box.call(ToolCall("echo", "{not json")),
        box.call(ToolCall("echo", "[1, 2]")),
        box.call(ToolCall("boom", "{}")),
    )
    assert unknown.text == "Unknown function 'nope'. Available tools: ['echo', 'boom']"
    assert bad_json.text.startswith("Invalid JSON in arguments for 'echo': ")
    assert not_object.text == "Invalid JSON in arguments for 'echo': expected a JSON object, " \
                              "got list"
    assert raised.text == "Error executing tool 'boom': kaput"
    assert all(o.failed for o in (unknown, bad_json, not_object, raised))
    assert boom.released == ["bare-id"]  # released although execute raised
    assert (box.calls, box.failures, box.timeouts) == (4, 4, 0)


@pytest.mark.asyncio
async def test_reward_metrics_create_kwargs_and_the_parallel_cut(boxes):
    echo = EchoTool({}, None)
    box = boxes([echo], max_parallel_calls=2)
    calls = [ToolCall("echo", f'{{"text": "t{i}", "reward": 0.5}}') for i in range(3)]
    kwargs = {"echo": {"create_kwargs": {"ground_truth": "42"}}, "other": {}}
    outputs = await box.call_all(calls, kwargs)
    assert [o.text for o in outputs] == ["t0", "t1"]
    assert outputs[0].reward == 0.5 and outputs[0].metrics == {"n": 1.0}
    assert echo.created == [{"create_kwargs": {"ground_truth": "42"}}] * 2
    assert sorted(echo.released) == ["id-1", "id-2"]
    assert (await box.call_all(calls[:1], None))[0].text == "t0"
    assert echo.created[-1] == {"create_kwargs": {}}


def test_truncation_as_verl():
    text = "abcdefghij"
    assert truncate(text, 4, "left") == "(truncated)...ghij"
    assert truncate(text, 4, "right") == "abcd...(truncated)"
    assert truncate(text, 4, "middle") == "ab...(truncated)...ij"
    assert truncate(text, 5, "middle") == "ab...(truncated)...ij"
    assert truncate(text, 1, "middle") == "...(truncated)..."
    assert truncate(text, 10, "left") == text


@pytest.mark.asyncio
async def test_the_box_truncates_and_refuses_bad_settings(boxes):
    box = boxes([EchoTool({}, None)], max_response_chars=4, truncate_side="right")
    out = await box.call(ToolCall("echo", '{"text": "abcdefghij"}'))
    assert out.text == "abcd...(truncated)" and not out.failed
    with pytest.raises(ValueError, match="truncate_side"):
        ToolBox([], timeout_s=1, truncate_side="both")
    with pytest.raises(ValueError, match=r"\['echo'\]"):
        ToolBox([EchoTool({}, None), EchoTool({}, None)], timeout_s=1)
    assert box.schemas == [_schema("echo")] and box.names == ["echo"]


@pytest.mark.asyncio
async def test_a_closed_box_answers_failed(boxes):
    box = boxes([EchoTool({}, None)])
    box.close()
    out = await box.call(ToolCall("echo", "{}"))
    assert out.failed and "closed" in out.text


# --------------------------------------------------------------------------- tool_config_path


TOOL_FILE = '''
class MyTool:
    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema["function"]["name"]

    async def create(self, instance_id=None, **kwargs):
        return "i", None

    async def execute(self, instance_id, parameters, **kwargs):
        return "k=" + str(self.config["k"]), 1.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        pass
'''


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _config(tmp_path: Path, class_name: str, name: str = "mine", extra: str = "") -> Path:
    path = tmp_path / "conf" / "tools.yaml"
    _write(path, f"""
        tools:
          - class_name: "{class_name}"
            config:
              type: native
              k: 7
            tool_schema:
              type: function
              function:
                name: {name}
                description: my tool
                strict: null
                parameters:
                  type: object
                  properties:
                    q: {{type: string, description: the query, items: {{type: string}}}}
                  required: [q]
        """)
    path.write_text(path.read_text() + textwrap.indent(textwrap.dedent(extra), "  "))  # more tools
    return path


@pytest.mark.asyncio
async def test_a_tool_class_from_a_file_next_to_the_yaml(tmp_path, monkeypatch, boxes):
    _write(tmp_path / "conf" / "impl" / "my_tool.py", TOOL_FILE)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    [tool] = load_tool_config(_config(tmp_path, "impl/my_tool.py:MyTool"))
    # A plain dict, as verl's model_dump(exclude_unset, exclude_none): None and keys its
    # schema has no field for are gone.
    assert tool.tool_schema == {"type": "function", "function": {
        "name": "mine", "description": "my tool", "parameters": {
            "type": "object", "properties": {"q": {"type": "string",
                                                   "description": "the query"}},
            "required": ["q"]}}}
    assert tool.config == {"type": "native", "k": 7}
    out = (await boxes([tool]).call_all([ToolCall("mine", '{"q": "x"}')], None))[0]
    assert (out.text, out.reward, out.failed) == ("k=7", 1.0, False)


def test_a_tool_file_that_imports_verl_is_named(tmp_path):
    bad = _write(tmp_path / "conf" / "bad.py", "from verl.tools.base_tool import BaseTool\n")
    with pytest.raises(ToolConfigError) as caught:
        load_tool_config(_config(tmp_path, "bad.py:Bad"))
    message = str(caught.value)
    assert "tools[0] (bad.py:Bad)" in message and str(tmp_path / "conf" / "tools.yaml") in message
    assert "imports verl" in message and "without verl" in message and str(bad) in message
    assert caught.value.key == "actor_rollout_ref.rollout.multi_turn.tool_config_path"


def test_duplicate_names_and_bad_entries(tmp_path):
    _write(tmp_path / "conf" / "my_tool.py", TOOL_FILE)
    twice = """
        - class_name: my_tool.py:MyTool
          config: {k: 1}
          tool_schema: {type: function, function: {name: mine, description: again}}
    """
    with pytest.raises(ToolConfigError, match=r"\['mine'\]"):
        load_tool_config(_config(tmp_path, "my_tool.py:MyTool", extra=twice))
    with pytest.raises(ToolConfigError, match=r"tools\[0\] \(my_tool.py:Nope\): .*has no 'Nope'"):
        load_tool_config(_config(tmp_path, "my_tool.py:Nope"))
    with pytest.raises(ToolConfigError, match="no such file"):
        load_tool_config(_config(tmp_path, "missing.py:MyTool"))
    with pytest.raises(ToolConfigError, match="verl's own module"):
        load_tool_config(_config(tmp_path, "verl.tools.search_tool.SearchTool"))


def test_builtins_by_the_names_verl_users_write(tmp_path, monkeypatch):
    sandbox = "agent.sandbox.CodeInterpreterTool"
    assert builtin_class_path("verl.tools.sandbox_fusion_tools.SandboxFusionTool") == sandbox
    assert builtin_class_path("recipe.retool.retool.CustomSandboxFusionTool") == sandbox
    assert builtin_class_path(sandbox) == sandbox
    assert builtin_class_path("agent.calculator.CalculatorTool") == \
           "agent.calculator.CalculatorTool"
    assert builtin_class_path("my.pkg.Other") is None
    # The built-in is imported by name when a config names it (a stand-in module here).
    stand_in = types.ModuleType("agent.sandbox")
    stand_in.CodeInterpreterTool = lambda config, tool_schema: EchoTool(config, tool_schema)
    monkeypatch.setitem(sys.modules, "agent.sandbox", stand_in)
    [tool] = load_tool_config(_config(tmp_path, "recipe.retool.retool.CustomSandboxFusionTool",
                                      name="code_interpreter"))
    assert tool.name == "code_interpreter" and tool.config["k"] == 7


def test_a_dotted_class_on_sys_path(tmp_path, monkeypatch):
    _write(tmp_path / "pkgdir" / "my_tools_pkg" / "__init__.py", TOOL_FILE)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgdir"))
    [tool] = load_tool_config(_config(tmp_path, "my_tools_pkg.MyTool"))
    assert tool.name == "mine"


# --------------------------------------------------------------------------- function_tool_path


FUNCTIONS_FILE = '''
from typing import Literal

from agent.toolbox import function_tool


@function_tool
def lookup(city: str, days: int = 1, unit: Literal["c", "f"] = "c") -> str:
    """Look up the weather forecast.

    Args:
        city: The city to look up,
            by its English name.
        days: How many days ahead.
        unit: The temperature unit.
    """
    return f"{city}:{days}:{unit}"


@function_tool("grade")
async def score(answer: str):
    """Grade an answer.

    Args:
        answer: The answer.
    """
    return answer, 1.0, {"len": len(answer)}


def helper():
    return None
'''


@pytest.mark.asyncio
async def test_function_tools_from_a_file(tmp_path, boxes):
    file = _write(tmp_path / "fns.py", FUNCTIONS_FILE)
    tools = load_function_tools(str(file))
    assert [t.name for t in tools] == ["lookup", "grade"]
    assert tools[0].tool_schema == {"type": "function", "function": {
        "name": "lookup", "description": "Look up the weather forecast.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string",
                     "description": "The city to look up, by its English name."},
            "days": {"type": "integer", "description": "How many days ahead."},
            "unit": {"type": "string", "description": "The temperature unit.",
                     "enum": ["c", "f"]}},
            "required": ["city"]}}}
    box = boxes(tools, max_parallel_calls=2)
    looked, graded = await box.call_all([ToolCall("lookup", '{"city": "Oslo", "days": 2}'),
                                         ToolCall("grade", '{"answer": "abc"}')], None)
    assert (looked.text, looked.reward, looked.failed) == ("Oslo:2:c", None, False)
    assert (graded.text, graded.reward, graded.metrics) == ("abc", 1.0, {"len": 3.0})


def test_function_tool_files_that_cannot_load(tmp_path):
    empty = _write(tmp_path / "empty.py", "def f():\n    return 1\n")
    with pytest.raises(ToolConfigError, match="no @function_tool") as caught:
        load_function_tools(empty)
    assert caught.value.key == FUNCTION_TOOL_KEY
    undocumented = _write(tmp_path / "undoc.py", """
        from agent.toolbox import function_tool

        @function_tool
        def f(x: int):
            '''Does f.'''
    """)
    with pytest.raises(ToolConfigError, match="does not describe 'x'"):
        load_function_tools(undocumented)
    verl_user = _write(tmp_path / "verl_user.py",
                       "from verl.tools.function_tool import function_tool\n")
    with pytest.raises(ToolConfigError, match="imports verl"):
        load_function_tools(verl_user)


def test_function_tool_decorator_forms():
    def plain(x: float) -> float:
        """Halve.

        Args:
            x (float): A number.
        """
        return x / 2

    assert function_tool(plain) is plain
    renamed = function_tool("half")(plain)
    assert renamed is plain
    given = function_tool(schema=_schema("given"))(lambda: "x")
    from agent.functiontool import marked_tool
    assert marked_tool(plain).name == "half"
    assert marked_tool(given).tool_schema == _schema("given")


def test_a_tool_written_for_verls_base_tool_reads_its_schema_as_there(tmp_path: Path) -> None:
    """verl's BaseTool reads ``tool_schema.function.name`` and dumps the schema with
    ``model_dump``: a tool that does so (without importing verl) loads here unchanged."""
    (tmp_path / "verlish.py").write_text(
        "class Echo:\n"
        "    def __init__(self, config, tool_schema):\n"
        "        self.config, self.tool_schema = config, tool_schema\n"
        "        self.name = self.tool_schema.function.name\n"
        "        self.dumped = tool_schema.model_dump(exclude_unset=True, exclude_none=True)\n"
        "        self.strict = tool_schema.function.strict\n"
        "    async def create(self, instance_id=None, **kw):\n"
        "        return 'i', None\n"
        "    async def execute(self, instance_id, parameters, **kw):\n"
        "        return parameters['text'], 0.0, {}\n"
        "    async def calc_reward(self, instance_id, **kw):\n"
        "        return 0.0\n"
        "    async def release(self, instance_id, **kw):\n"
        "        pass\n")
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: verlish.py:Echo\n    config: {}\n    tool_schema:\n"
        "      type: function\n      function:\n        name: echo\n"
        "        description: says it back\n"
        "        parameters: {type: object, properties: {text: {type: string}}}\n")
    (tool,) = load_tool_config(tmp_path / "tools.yaml")
    assert tool.name == "echo" and tool.strict is None
    assert tool.dumped == {"type": "function", "function": {
        "name": "echo", "description": "says it back",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}
    assert type(tool.dumped) is dict and schema_dict(tool) == tool.dumped
