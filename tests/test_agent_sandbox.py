"""agent.sandbox: the local code interpreter. Its children are ``python -I -c`` runs, not
rlbus components: the fast tier allows them (tests/tiers.py refuses ``python -m`` of the
project's packages and scripts of the tree, and a ``-c`` is neither)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.sandbox import (
    CodeInterpreterTool,
    CodeSandbox,
    print_last_expression,
    strip_code_fence,
)
from agent.tool import Tool


def sandbox(workers: int = 2, **kw: object) -> CodeSandbox:
    limits: dict[str, object] = {"wall_s": 20.0, "cpu_s": 10.0, "memory_mb": 512,
                                 "max_output_chars": 2000}
    limits.update(kw)
    return CodeSandbox(workers, **limits)  # type: ignore[arg-type]


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections (from outside the sandbox)."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@pytest.mark.asyncio
async def test_runs_code_and_reports_errors() -> None:
    box = sandbox()
    ok = await box.run("import sys\nprint(sys.stdin.read().upper())", stdin="hi")
    assert (ok.status, ok.stdout, ok.return_code) == ("ok", "HI\n", 0)
    failed = await box.run("print('before')\n1/0")
    assert failed.status == "error" and failed.return_code == 1
    assert failed.stdout == "before\n"
    assert failed.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in failed.stderr  # the bootstrap's frame is not the model's business
    syntax = await box.run("def f(:")
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr


@pytest.mark.asyncio
async def test_an_endless_loop_times_out_and_the_next_call_works() -> None:
    box = sandbox(workers=1, wall_s=20.0, cpu_s=1.0)
    looping = await box.run("while True:\n    pass")
    assert looping.status == "timeout"
    assert (await box.run("print(2)")).stdout == "2\n"


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.asyncio
async def test_the_wall_limit_kills_the_whole_group() -> None:
    box = sandbox(workers=1, wall_s=3.0)
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    print(os.getpid(), flush=True)\n"
            "    time.sleep(60)\n"
            "time.sleep(60)")
    slept = await box.run(code)
    assert slept.status == "timeout" and slept.return_code is not None
    assert slept.return_code < 0
    forked = int(slept.stdout.split()[0])
    for _ in range(100):  # SIGKILL is sent; its delivery is the kernel's
        if not _running(forked):
            break
        await asyncio.sleep(0.05)
    assert not _running(forked)


@pytest.mark.asyncio
async def test_ten_gigabytes_end_as_memory_and_the_pool_goes_on() -> None:
    box = sandbox(workers=1, memory_mb=256)
    for code in ("b = bytearray(10 * 2**30)", "x = ' ' * (10 * 2**30)",
                 "chunks = []\nwhile True:\n    chunks.append(bytearray(2**26))"):
        result = await box.run(code)
        assert result.status == "memory", (code, result)
        assert "MemoryError" in result.stderr
    assert (await box.run("print('alive')")).stdout == "alive\n"


@pytest.mark.asyncio
@pytest.mark.parametrize("network", ["auto", "audit"])
async def test_no_network(network: str, listening_port: int) -> None:
    box = sandbox(network=network)  # type: ignore[arg-type]
    isolation = await box.network_isolation()
    assert isolation in ("unshare", "audit")
    code = ("import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {listening_port}), timeout=3)\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('refused', type(e).__name__, e)\n")
    result = await box.run(code)
    assert result.status == "ok", result
    assert result.stdout.startswith("refused"), result.stdout
    # The same connection from here works: the refusal is the sandbox's.
    socket.create_connection(("127.0.0.1", listening_port), timeout=3).close()


@pytest.mark.asyncio
async def test_audit_mode_refuses_other_programs() -> None:
    result = await sandbox(network="audit").run("import subprocess\nsubprocess.run(['true'])")
    assert result.status == "error" and "PermissionError" in result.stderr


def _exists(path: str) -> bool:
    return os.path.exists(path)


@pytest.mark.asyncio
async def test_each_call_gets_a_fresh_working_directory() -> None:
    box = sandbox()
    first = await box.run("import os\nopen('marker.txt', 'w').write('x')\nprint(os.getcwd())")
    second = await box.run("import os\nprint(os.path.exists('marker.txt'), os.getcwd())")
    assert first.status == second.status == "ok"
    exists, cwd = second.stdout.split()
    assert exists == "False" and cwd != first.stdout.strip()
    assert not _exists(first.stdout.strip())  # removed after the call


@pytest.mark.asyncio
async def test_the_environment_is_stripped() -> None:
    os.environ["RLBUS_SANDBOX_SECRET"] = "x"
    try:
        result = await sandbox().run("import os, sys\nprint(sorted(os.environ))\n"
                                     "print(sys.flags.isolated)")
    finally:
        del os.environ["RLBUS_SANDBOX_SECRET"]
    names, isolated = result.stdout.splitlines()
    assert "RLBUS_SANDBOX_SECRET" not in names and "PATH" in names
    assert isolated == "1"


@pytest.mark.asyncio
async def test_output_is_truncated_with_a_note() -> None:
    box = sandbox(max_output_chars=100)
    result = await box.run("import sys\nprint('x' * 100000)\n"
                           "sys.stderr.write('e' * 5000 + 'THE END')")
    assert result.status == "ok"
    assert result.stdout.startswith("x" * 100)
    assert "truncated" in result.stdout and len(result.stdout) < 300
    assert result.stderr.endswith("THE END") and "truncated" in result.stderr
    assert len(result.stderr) < 300


@pytest.mark.asyncio
async def test_at_most_workers_run_at_once() -> None:
    box = sandbox(workers=2)
    code = ("import json, time\n"
            "start = time.time()\n"
            "time.sleep(0.3)\n"
            "print(json.dumps([start, time.time()]))")
    results = await asyncio.gather(*(box.run(code) for _ in range(6)))
    spans = [json.loads(r.stdout) for r in results]
    # Most children alive at the same moment, by the times they wrote themselves.
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans],
                    key=lambda event: (event[0], event[1]))
    alive = most = 0
    for _, step in events:
        alive += step
        most = max(most, alive)
    assert most <= 2


def test_strip_code_fence() -> None:
    assert strip_code_fence("```python\nprint(1)\n```") == "print(1)"
    assert strip_code_fence("Let me compute:\n```py\nx = 1\nx\n```\nthen ```python\nno\n```") \
        == "x = 1\nx"
    assert strip_code_fence("print(1)") == "print(1)"


@pytest.mark.parametrize(("code", "printed"), [
    ("x = 3\nx * 2", True),
    ("x = 3\nx * 2  # doubled\n\n", True),
    ("a = 1; a", True),
    ("(1 +\n 2)", True),
    ("print(5)", False),
    ("x = 5", False),
    ("def f(:", False),
    ("", False),
])
def test_print_last_expression(code: str, printed: bool) -> None:
    shown = print_last_expression(code)
    assert (shown != code) == printed
    if printed:
        compile(shown, "<code>", "exec")


@pytest.mark.asyncio
async def test_last_expression_is_printed_unless_none() -> None:
    box = sandbox()
    assert (await box.run(print_last_expression("x = 21\nx * 2"))).stdout == "42\n"
    assert (await box.run(print_last_expression("x = None\nx"))).stdout == ""
    error = await box.run(print_last_expression("x = 1\n\ny = 0\nx / y"))
    assert "line 4" in error.stderr  # the line numbers stay the code's


@pytest.mark.asyncio
async def test_tool_execute() -> None:
    tool = CodeInterpreterTool({"default_timeout": 5, "cpu_timeout": 1, "memory_limit_mb": 256},
                               None)
    assert isinstance(tool, Tool) and tool.name == "code_interpreter"
    instance, _ = await tool.create()
    text, reward, metrics = await tool.execute(instance, {"code": "```python\nx = 6\nx * 7\n```"})
    assert (text, reward) == ("42\n", 0.0)
    assert metrics["sandbox_ok"] == 1.0 and metrics["sandbox_timeout"] == 0.0
    assert all(isinstance(v, float) for v in metrics.values())
    text, _, metrics = await tool.execute(instance, {"code": "print('partial')\n1/0"})
    assert text.startswith("partial\nTraceback") and "ZeroDivisionError" in text
    assert metrics["sandbox_ok"] == 0.0
    text, _, metrics = await tool.execute(instance, {"code": "while True: pass"})
    assert text == "Execution timed out after 5 s" and metrics["sandbox_timeout"] == 1.0
    text, _, metrics = await tool.execute(instance, {"code": "b = bytearray(10 * 2**30)"})
    assert "ran out of memory" in text and metrics["sandbox_memory"] == 1.0
    text, reward, _ = await tool.execute(instance, {"source": "print(1)"})
    assert "code" in text and reward == 0.0
    assert await tool.calc_reward(instance) == 0.0
    await tool.release(instance)


def test_tool_schema_and_languages() -> None:
    schema = {"type": "function", "function": {"name": "python", "description": "d",
                                                "parameters": {"type": "object"}}}
    assert CodeInterpreterTool({}, schema).name == "python"
    with pytest.raises(ValueError, match="sandbox_fusion_url"):
        CodeInterpreterTool({"default_language": "cpp"}, None)
    remote = CodeInterpreterTool({"default_language": "cpp",
                                  "sandbox_fusion_url": "http://127.0.0.1:1/run_code"}, None)
    assert remote.language == "cpp"


def test_tool_runs_on_the_loop_that_calls_it() -> None:
    """The toolbox runs tools on loop threads of its own: one tool, two loops in turn."""
    tool = CodeInterpreterTool({}, None)
    for _ in range(2):
        text, _, _ = asyncio.run(tool.execute("i", {"code": "print('x')"}))
        assert text == "x\n"


@pytest.mark.asyncio
async def test_cancelling_a_call_kills_its_child(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    call = asyncio.create_task(sandbox(wall_s=60.0).run(code))
    for _ in range(400):
        if _exists(str(pid_file)) and pid_file.read_text():
            break
        await asyncio.sleep(0.05)
    pid = int(pid_file.read_text())
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not _running(pid)


@pytest.mark.asyncio
async def test_a_process_that_leaves_the_group_does_not_hold_the_call() -> None:
    """A child in a new session escapes the group kill and keeps the pipes open: the call
    ends anyway, with what was printed (the child ends by itself a little later)."""
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    time.sleep(3)\n"
            "    os._exit(0)\n"
            "print('parent done')")
    result = await sandbox(wall_s=60.0).run(code)
    assert (result.status, result.stdout) == ("ok", "parent done\n")
