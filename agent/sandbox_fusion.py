"""A client of a SandboxFusion service (``run_code``), for the code interpreter tool when
``sandbox_fusion_url`` is set: the code runs on the service's machines instead of this one,
as verl's SandboxFusion tool runs it.

The request and the reply are SandboxFusion's ``run_code`` API as verl's client uses it: the
URL is the whole ``run_code`` endpoint (verl's ``sandbox_fusion_url``); the request carries
``code``, ``language``, ``run_timeout``, ``compile_timeout``, ``memory_limit_MB`` and
``stdin``; the reply's ``status`` ("Success", "Failed", "SandboxError") says how the call
went, its ``compile_result`` and ``run_result`` (``status`` "Finished", "TimeLimitExceeded",
"Error"; ``stdout``, ``stderr``, ``return_code``, ``execution_time``) what the code did.

The outcome is an :class:`agent.sandbox.RunResult`, as the local sandbox gives: the tool
reads both alike. Whatever goes wrong with the service (refused connection, an HTTP error,
no reply in time, a reply that is not the API's JSON) becomes status "error" with a line
naming the URL, never an exception: a rollout goes on when the service does not. The venv
has no async HTTP client, so the request is urllib's in a thread; the thread is bounded by
the socket timeout (``run_timeout`` plus a margin), the call by the same bound in total.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
import weakref
from typing import Any

from agent.sandbox import RunResult, Status, truncated

__all__ = ["SandboxFusionClient", "run_result_of"]

HTTP_MARGIN_S = 10.0
"""What a reply may take beyond the code's own time limits (verl's client allows 10 s)."""


class SandboxFusionClient:
    """Runs code on the SandboxFusion service at ``url`` (its ``run_code`` endpoint), at most
    ``concurrency`` requests at once per event loop; ``run_timeout`` and ``memory_limit_mb``
    are the service's limits for each run, ``max_output_chars`` what is kept of stdout and
    of stderr each."""

    def __init__(self, url: str, *, language: str = "python", run_timeout: float = 30.0,
                 memory_limit_mb: int = 1024, max_output_chars: int = 8192,
                 concurrency: int = 4, http_margin_s: float = HTTP_MARGIN_S) -> None:
        self.url = url
        self.language = language
        self.run_timeout = run_timeout
        self.memory_limit_mb = memory_limit_mb
        self.max_output_chars = max_output_chars
        self.concurrency = concurrency
        # The service may compile first (other languages) within the same bound again.
        self.http_timeout_s = 2 * run_timeout + http_margin_s
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        slot = self._slots.get(loop)
        if slot is None:
            slot = self._slots[loop] = asyncio.Semaphore(self.concurrency)
        return slot

    async def run(self, code: str, stdin: str = "") -> RunResult:
        """Run ``code`` on the service; never raises for what the code or the service does."""
        payload = json.dumps({
            "code": code, "language": self.language, "stdin": stdin,
            "run_timeout": self.run_timeout, "compile_timeout": self.run_timeout,
            "memory_limit_MB": self.memory_limit_mb, "files": {}, "fetch_files": [],
        }).encode()
        async with self._slot():
            started = time.monotonic()
            try:
                reply = await asyncio.wait_for(asyncio.to_thread(self._post, payload),
                                               self.http_timeout_s + 1.0)
            except TimeoutError:
                reply = f"no reply within {self.http_timeout_s:g} s"
            seconds = time.monotonic() - started
        if isinstance(reply, str):
            return RunResult("error", "", f"SandboxFusion at {self.url}: {reply}", None, seconds)
        result = run_result_of(reply, seconds)
        if result is None:
            return RunResult("error", "", f"SandboxFusion at {self.url} replied with JSON that "
                             f"is not a run_code reply: {json.dumps(reply)[:200]}", None, seconds)
        limit = self.max_output_chars
        return result._replace(stdout=truncated(result.stdout, limit),
                               stderr=truncated(result.stderr, limit, tail=True))

    def _post(self, payload: bytes) -> dict[str, Any] | str:
        """The reply's JSON object, or why there is none (one line)."""
        request = urllib.request.Request(
            self.url, data=payload, method="POST",
            headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.http_timeout_s) as response:
                body = response.read(64 << 20)
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code} {e.reason}"
        except urllib.error.URLError as e:
            return f"unreachable ({e.reason})"
        except (OSError, ValueError) as e:  # timeouts, resets, a malformed URL
            return f"request failed ({type(e).__name__}: {e})"
        try:
            reply = json.loads(body)
        except ValueError:
            return f"replied with something that is not JSON: {body[:100]!r}"
        return reply if isinstance(reply, dict) else f"replied with JSON that is not an " \
                                                     f"object: {body[:100]!r}"


def run_result_of(reply: dict[str, Any], seconds: float) -> RunResult | None:
    """A ``run_code`` reply as a :class:`RunResult` (untruncated), or None when the reply
    is not one. A compile step that failed or ran out of time is the run's outcome."""
    api_status = reply.get("status")
    if api_status not in ("Success", "Failed", "SandboxError"):
        return None
    if api_status == "SandboxError":
        message = reply.get("message") or "no message"
        return RunResult("error", "", f"SandboxFusion: sandbox error ({message})", None,
                         seconds)
    compile_result = reply.get("compile_result")
    if isinstance(compile_result, dict) and _failed(compile_result):
        return _outcome(compile_result, seconds)
    run_result = reply.get("run_result")
    if not isinstance(run_result, dict):
        return RunResult("error", "", f"SandboxFusion: {api_status} without a run result "
                         f"({reply.get('message') or 'no message'})", None, seconds)
    return _outcome(run_result, seconds)


def _failed(step: dict[str, Any]) -> bool:
    return step.get("status") != "Finished" or step.get("return_code") not in (0, None)


def _outcome(step: dict[str, Any], seconds: float) -> RunResult:
    stdout = str(step.get("stdout") or "")
    stderr = str(step.get("stderr") or "")
    code = step.get("return_code")
    return_code = code if isinstance(code, int) else None
    status: Status
    if step.get("status") == "TimeLimitExceeded":
        status = "timeout"
    elif step.get("status") == "Finished" and return_code == 0:
        status = "ok"
    elif _ran_out_of_memory(stderr):
        status = "memory"
    else:
        status = "error"
    return RunResult(status, stdout, stderr, return_code, seconds)


def _ran_out_of_memory(stderr: str) -> bool:
    """The service reports memory as any other failure: a traceback ending in MemoryError."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return bool(lines) and lines[-1].startswith("MemoryError")
