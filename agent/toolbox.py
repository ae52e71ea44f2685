"""The run's tools and how a conversation calls them: :class:`ToolBox` runs the calls of one
assistant turn off the caller's event loop, each bounded in time, and turns whatever a tool
does (returns, raises, hangs, is not there) into a :class:`~agent.tool.ToolOutput` as verl's
tool agent loop tells the model, so a rollout never stops on a tool.

Why threads of their own: a tool is user code, and user code blocks (``time.sleep`` or a
blocking HTTP client inside ``async def``). On the rollouter's event loop that would stop every
rollout and the engine's feeding; so each box thread runs its own event loop, a call goes to the
least busy one, and the caller only awaits a future. A call past ``timeout_s`` is answered as
timed out at ``timeout_s`` even when its thread stays blocked; that thread counts as busy until
the call really ends, so later calls go to the others.

Loading (verl's ``tool_config_path`` and ``function_tool_path``) is :mod:`agent.toolconfig`
and :mod:`agent.functiontool`; their entry points are re-exported here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from agent.functiontool import FunctionTool, function_tool
from agent.tool import Tool, ToolOutput, response_text
from agent.toolcall import ToolCall
from agent.toolconfig import (
    ToolConfigError,
    check_unique_names,
    load_function_tools,
    load_tool_config,
    plain_schema,
    tool_name,
)

__all__ = [
    "TRUNCATE_SIDES",
    "FunctionTool",
    "ToolBox",
    "ToolConfigError",
    "function_tool",
    "load_function_tools",
    "load_tool_config",
    "load_tools",
    "schema_dict",
    "tool_schemas",
    "truncate",
]

TRUNCATE_SIDES = ("left", "right", "middle")
"""verl's ``multi_turn.tool_response_truncate_side`` values."""

_DRAIN_S = 1.0  # a stopping thread gives its cancelled calls this long to release


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """A tool response cut to ``limit`` characters plus verl's marker: ``left`` keeps the
    tail, ``right`` the head, ``middle`` half of each."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[len(text) - limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    # text[len - half:], not verl's text[-half:]: with half 0 that would be the whole text.
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


def load_tools(multi_turn: Any) -> list[Tool]:
    """The run's tools (``rollout.multi_turn``): those of ``tool_config_path``, then the
    functions of ``function_tool_path``; one name each across both (ToolConfigError)."""
    tools: list[Tool] = []
    if multi_turn.tool_config_path:
        tools += load_tool_config(multi_turn.tool_config_path)
    if multi_turn.function_tool_path:
        tools += load_function_tools(multi_turn.function_tool_path)
    check_unique_names(tools)
    return tools


def tool_schemas(multi_turn: Any) -> tuple[dict[str, Any], ...]:
    """The schemas of the run's tools (the chat template's ``tools=`` of a ``tool_agent``
    prompt); none when ``multi_turn.enable`` is off."""
    if not multi_turn.enable:
        return ()
    return tuple(schema_dict(t) for t in load_tools(multi_turn))


def schema_dict(tool: Any) -> dict[str, Any]:
    """A tool's schema as the chat template's ``tools=`` takes it: a plain dict as verl dumps
    its pydantic schema (a pydantic one is dumped the same way)."""
    schema = tool.tool_schema
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump(exclude_unset=True, exclude_none=True)
    if not isinstance(schema, Mapping):
        raise ValueError(f"tool {tool_name(tool)!r}: tool_schema is a "
                         f"{type(schema).__name__}, not an OpenAI schema mapping")
    return plain_schema(schema)


class _ToolThread:
    """A thread running an event loop of its own, on which tool calls run; ``in_flight``
    counts the calls given to it that have not ended there (a call answered as timed out
    while the thread is blocked still counts)."""

    def __init__(self, index: int) -> None:
        self.loop = asyncio.new_event_loop()
        # asyncio.to_thread in a tool uses this pool; shut down without waiting on close.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            thread_name_prefix=f"rlbus-tool-{index}-worker")
        self.loop.set_default_executor(self._pool)
        self._lock = threading.Lock()
        self.in_flight = 0
        self.thread = threading.Thread(target=self._run, name=f"rlbus-tool-{index}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self._drain()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.loop.close()

    def _drain(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.wait(tasks, timeout=_DRAIN_S))

    def submit(self, make: Callable[[], Awaitable[Any]]) -> concurrent.futures.Future[Any]:
        """Run ``make()`` on this thread's loop. A call cancelled before it started there
        (it waited behind a blocked one) never starts, and stops counting then."""
        state = ["pending"]
        with self._lock:
            self.in_flight += 1

        async def run() -> Any:
            with self._lock:
                if state[0] == "abandoned":
                    return None
                state[0] = "running"
            try:
                return await make()
            finally:
                with self._lock:
                    self.in_flight -= 1

        def settled(_: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                if state[0] == "pending":
                    state[0] = "abandoned"
                    self.in_flight -= 1

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        future.add_done_callback(settled)
        return future

    def stop(self) -> None:
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # closed between the check and the call
                pass


def _no_span(name: str) -> AbstractContextManager[Any]:
    """No range around a tool call (a toolbox without a profiler)."""
    return contextlib.nullcontext()


class ToolBox:
    """The run's tools, called as verl's tool agent loop calls them, on ``threads`` threads
    of their own. ``schemas`` (the chat template's ``tools=``) and ``names`` are in the
    tools' order. ``calls``, ``failures`` and ``timeouts`` count the calls made (a timeout
    is also a failure), for the rollouter's metrics. ``span(name)``: a context manager each
    call runs in on its tool thread (the rollouter's: a profiler range, so that a profiled
    step shows its tool calls)."""

    def __init__(self, tools: Sequence[Tool], *, timeout_s: float, threads: int = 2,
                 max_response_chars: int = 256, truncate_side: str = "middle",
                 max_parallel_calls: int = 1,
                 span: Callable[[str], AbstractContextManager[Any]] = _no_span) -> None:
        _check_settings(timeout_s, threads, max_response_chars, truncate_side,
                        max_parallel_calls)
        check_unique_names(tools)
        self.timeout_s = float(timeout_s)
        self.max_response_chars = max_response_chars
        self.truncate_side = truncate_side
        self.max_parallel_calls = max_parallel_calls
        self.span = span
        self._tools = {tool_name(tool): tool for tool in tools}
        self.names = list(self._tools)
        self.schemas = [schema_dict(tool) for tool in tools]
        self.calls = 0
        self.failures = 0
        self.timeouts = 0
        self._counts = threading.Lock()
        self._closed = False
        self._threads = [_ToolThread(i) for i in range(threads)]

    async def call_all(self, calls: Sequence[ToolCall],
                       tools_kwargs: Mapping[str, Any] | None = None) -> list[ToolOutput]:
        """The outputs of the first ``max_parallel_calls`` calls (verl drops the rest), run
        concurrently, in the calls' order. ``tools_kwargs``: a sample's per-tool keywords
        (``{name: {"create_kwargs": {...}}}``, verl's). Never raises."""
        chosen = list(calls)[:self.max_parallel_calls]
        return list(await asyncio.gather(*(self.call(c, tools_kwargs) for c in chosen)))

    async def call(self, call: ToolCall,
                   tools_kwargs: Mapping[str, Any] | None = None) -> ToolOutput:
        """One call's output (its ``seconds`` the wall time the caller waited). Never raises."""
        started = time.monotonic()
        output, timed_out = await self._outcome(call, tools_kwargs)
        output = output._replace(seconds=time.monotonic() - started)
        with self._counts:
            self.calls += 1
            self.failures += output.failed
            self.timeouts += timed_out
        return output

    async def _outcome(self, call: ToolCall,
                       tools_kwargs: Mapping[str, Any] | None) -> tuple[ToolOutput, bool]:
        """The call's output and whether it timed out."""
        tool = self._tools.get(call.name)
        if tool is None:
            return _failed(f"Unknown function '{call.name}'. Available tools: {self.names}"), \
                False
        try:
            arguments = _arguments(call)
        except ValueError as exc:
            return _failed(f"Invalid JSON in arguments for '{call.name}': {exc}"), False
        if self._closed:
            return _failed(f"Error executing tool '{call.name}': the toolbox is closed"), False
        create_kwargs = _create_kwargs(tools_kwargs, call.name)
        thread = min(self._threads, key=lambda t: t.in_flight)
        waiting = asyncio.wrap_future(
            thread.submit(lambda: _run_tool(tool, arguments, create_kwargs,
                                            self.span(f"tool:{call.name}"))))
        try:
            done, _ = await asyncio.wait({waiting}, timeout=self.timeout_s)
        finally:
            if not waiting.done():  # timed out, or the caller was cancelled: stop it there
                waiting.cancel()
        if not done:
            return _failed(f"Tool '{call.name}' timed out after {self.timeout_s:g} s"), True
        try:
            return self._output(waiting.result()), False
        except Exception as exc:
            return _failed(f"Error executing tool '{call.name}': {exc}"), False

    def _output(self, returned: Any) -> ToolOutput:
        response, reward, metrics = _execute_parts(returned)
        text = truncate(response_text(response), self.max_response_chars, self.truncate_side)
        return ToolOutput(text, None if reward is None else float(reward),
                          _numeric(metrics))

    def close(self, join_s: float = 5.0) -> None:
        """Stop the threads, waiting at most ``join_s`` in all (a thread blocked in a tool is
        left to end by itself: they are daemons). Calls after this fail."""
        if self._closed:
            return
        self._closed = True
        for thread in self._threads:
            thread.stop()
        deadline = time.monotonic() + join_s
        for thread in self._threads:
            thread.thread.join(max(0.0, deadline - time.monotonic()))


def _check_settings(timeout_s: float, threads: int, max_response_chars: int,
                    truncate_side: str, max_parallel_calls: int) -> None:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, not {timeout_s!r}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, not {threads!r}")
    if max_response_chars < 1:
        raise ValueError(f"max_response_chars must be >= 1, not {max_response_chars!r}")
    if truncate_side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate_side {truncate_side!r}: one of {list(TRUNCATE_SIDES)}")
    if max_parallel_calls < 1:
        raise ValueError(f"max_parallel_calls must be >= 1, not {max_parallel_calls!r}")


async def _run_tool(tool: Tool, arguments: dict[str, Any], create_kwargs: dict[str, Any],
                    span: AbstractContextManager[Any]) -> Any:
    """One call on a tool thread, as verl's agent loop makes it: create an instance, execute,
    and release the instance whatever happened; all of it within ``span``."""
    with span:
        created = await tool.create(create_kwargs=create_kwargs)
        instance_id = created[0] if isinstance(created, tuple) else created
        try:
            return await tool.execute(instance_id, arguments)
        finally:
            await tool.release(instance_id)



def _failed(text: str) -> ToolOutput:
    return ToolOutput(text, failed=True)


def _arguments(call: ToolCall) -> dict[str, Any]:
    """The call's arguments: a JSON object, else a ValueError saying what they are."""
    arguments = json.loads(call.arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f"expected a JSON object, got {type(arguments).__name__}")
    return arguments


def _create_kwargs(tools_kwargs: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    own = tools_kwargs.get(name) if isinstance(tools_kwargs, Mapping) else None
    create_kwargs = own.get("create_kwargs") if isinstance(own, Mapping) else None
    return dict(create_kwargs) if isinstance(create_kwargs, Mapping) else {}


def _execute_parts(returned: Any) -> tuple[Any, Any, Any]:
    """``execute``'s return as (response, reward, metrics): verl's triple, a shorter tuple,
    or a bare response."""
    if isinstance(returned, tuple) and 1 <= len(returned) <= 3:
        padded = (*returned, None, None)
        return padded[0], padded[1], padded[2]
    return returned, None, None


def _numeric(metrics: Any) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        return {}
    return {str(k): float(v) for k, v in metrics.items() if isinstance(v, int | float)}
