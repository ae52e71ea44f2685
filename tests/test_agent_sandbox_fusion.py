"""agent.sandbox_fusion: the SandboxFusion client, against the stand-in service of
tests/sandbox_fusion_server.py (a thread here; its children are ``python -I -c`` runs)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from agent.sandbox import CodeInterpreterTool
from agent.sandbox_fusion import SandboxFusionClient, run_result_of
from tests.sandbox_fusion_server import serving


@pytest.fixture
def service() -> Iterator[str]:
    with serving() as url:
        yield url


def client(url: str, **kw: object) -> SandboxFusionClient:
    options: dict[str, object] = {"run_timeout": 10.0, "max_output_chars": 1000}
    options.update(kw)
    return SandboxFusionClient(url, **options)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_success_and_failure(service: str) -> None:
    box = client(f"{service}/run_code")
    ok = await box.run("import sys\nprint(sys.stdin.read() * 2)", stdin="ab")
    assert (ok.status, ok.stdout, ok.return_code) == ("ok", "abab\n", 0)
    failed = await box.run("raise ValueError('no')")
    assert failed.status == "error" and failed.return_code == 1
    assert "ValueError: no" in failed.stderr
    memory = await box.run("raise MemoryError")
    assert memory.status == "memory"


@pytest.mark.asyncio
async def test_timeout(service: str) -> None:
    result = await client(f"{service}/run_code", run_timeout=1.0).run(
        "import time\ntime.sleep(30)")
    assert result.status == "timeout"


@pytest.mark.asyncio
async def test_output_is_truncated(service: str) -> None:
    result = await client(f"{service}/run_code", max_output_chars=50).run("print('y' * 5000)")
    assert result.status == "ok" and "truncated" in result.stdout
    assert len(result.stdout) < 200


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.asyncio
async def test_a_service_that_is_down_is_an_error_naming_it() -> None:
    url = f"http://127.0.0.1:{_closed_port()}/run_code"
    result = await client(url).run("print(1)")
    assert result.status == "error" and url in result.stderr
    assert "\n" not in result.stderr


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "says"), [
    ("/garbage", "not JSON"), ("/error", "HTTP 500"), ("/sandbox_error", "no runner"),
])
async def test_replies_that_are_not_a_run(service: str, path: str, says: str) -> None:
    result = await client(f"{service}{path}").run("print(1)")
    assert result.status == "error" and says in result.stderr
    assert result.stdout == ""


def test_run_result_of_compile_failures_and_strangers() -> None:
    compile_failed = {"status": "Failed", "compile_result": {
        "status": "Finished", "return_code": 1, "stdout": "", "stderr": "main.cpp: error"},
        "run_result": None}
    result = run_result_of(compile_failed, 0.5)
    assert result is not None and result.status == "error"
    assert result.stderr == "main.cpp: error"
    compile_slow = {"status": "Failed", "compile_result": {"status": "TimeLimitExceeded"}}
    result = run_result_of(compile_slow, 0.5)
    assert result is not None and result.status == "timeout"
    assert run_result_of({"hello": "world"}, 0.1) is None


@pytest.mark.asyncio
async def test_the_tool_over_the_service(service: str) -> None:
    tool = CodeInterpreterTool({"sandbox_fusion_url": f"{service}/run_code",
                                "default_timeout": 1}, None)
    text, reward, metrics = await tool.execute("i", {"code": "```python\nx = 4\nx ** 2\n```"})
    assert (text, reward, metrics["sandbox_ok"]) == ("16\n", 0.0, 1.0)
    text, _, metrics = await tool.execute("i", {"code": "while True: pass"})
    assert text == "Execution timed out after 1 s" and metrics["sandbox_timeout"] == 1.0
    down = CodeInterpreterTool({"sandbox_fusion_url": f"http://127.0.0.1:{_closed_port()}/x"},
                               None)
    text, reward, metrics = await down.execute("i", {"code": "print(1)"})
    assert "SandboxFusion at http://127.0.0.1" in text and reward == 0.0
    assert metrics["sandbox_ok"] == 0.0
