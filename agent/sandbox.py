"""A Python code interpreter for tool calls (ReTool's ``code_interpreter``), run on this
machine in short-lived sandboxed children, and :class:`CodeInterpreterTool`, the tool of
verl's interface over it (or over a SandboxFusion service, :mod:`agent.sandbox_fusion`).

The code comes from the policy being trained: it is untrusted, and a run must neither take
the rollouter down nor wedge it. So each call of :meth:`CodeSandbox.run` gets

- a fresh ``python -I`` child (isolated mode: no user site, ``PYTHON*`` variables ignored,
  neither the script's folder nor the cwd on ``sys.path``), started with
  :func:`asyncio.create_subprocess_exec` so the event loop never blocks on it, with an
  environment cut down to a few variables and a fresh temporary working directory, removed
  afterwards (a file one call writes is not there for the next);
- resource limits the child sets on itself before it reads the code (a small bootstrap given
  with ``-c``, not ``preexec_fn``, which is unsafe in a process with threads, as the
  toolbox's is): ``RLIMIT_CPU`` (SIGXCPU: "timeout"), ``RLIMIT_AS`` (an allocation past it
  raises MemoryError: "memory", instead of the machine running out), ``RLIMIT_FSIZE``,
  ``RLIMIT_NPROC`` and no core dumps;
- its own session, so the wall-clock limit kills the whole process group, children included;
- no network: in a new network namespace (``unshare --net --map-root-user``: only a loopback
  that is down) where this machine allows it, checked once per process; otherwise an audit
  hook (:func:`sys.addaudithook`) the bootstrap installs, which refuses socket connects,
  binds, sends and name lookups, and starting other programs. The hook is no security
  boundary (``ctypes`` or a C extension goes around it): it keeps honest code off the
  network, nothing more. :meth:`CodeSandbox.network_isolation` says which is in force.

What the limits do not cover: as root, the kernel does not enforce ``RLIMIT_NPROC`` (a fork
bomb is bounded by the CPU and wall limits and the group kill only); a child that starts a
new session escapes the group kill and lives on (the call still ends, two seconds after the
rest, its pipes closed); the disk the children write is bounded per file, not in
total. The children run as the rollouter's user and can read what it can read.

At most ``workers`` children run at once on one event loop; more calls wait their turn.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
import weakref
from typing import Any, Literal, NamedTuple

from agent.tool import schema_name

__all__ = [
    "CodeInterpreterTool",
    "CodeSandbox",
    "RunResult",
    "Status",
    "print_last_expression",
    "strip_code_fence",
    "truncated",
]

Status = Literal["ok", "error", "timeout", "memory", "killed"]

MEMORY_EXIT = 86
"""The child's exit status when its code ran out of memory (the bootstrap's; code that exits
with it itself reads as "memory" too, which harms nobody)."""

CHILD_ENV_KEEP = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # One thread per numerical library: each thread's stack and arena count in RLIMIT_AS.
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "2",
    "MPLBACKEND": "Agg",
}
"""The child's whole environment, with HOME and TMPDIR its working directory."""

REFUSED_EVENTS = (
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn",
)
"""Audit events the fallback hook refuses: the network, and other programs (which the hook
would not see)."""

_BOOTSTRAP = r"""
import json, os, resource, sys, traceback
_cfg = json.loads(sys.argv[1])

def _limit(kind, value, slack=0):
    hard = resource.getrlimit(kind)[1]
    top = value + slack if hard == resource.RLIM_INFINITY else min(value + slack, hard)
    resource.setrlimit(kind, (min(value, top), top))

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
_limit(resource.RLIMIT_CPU, _cfg["cpu"], 1)  # SIGXCPU, a second later SIGKILL
_limit(resource.RLIMIT_AS, _cfg["as"])
_limit(resource.RLIMIT_FSIZE, _cfg["fsize"])
_limit(resource.RLIMIT_NPROC, _cfg["nproc"])
if _cfg["refused"]:
    def _refuse(event, args, _refused=frozenset(_cfg["refused"])):
        if event in _refused:
            raise PermissionError(f"{event}: no network or other programs in this sandbox")
    sys.addaudithook(_refuse)
_path = _cfg["path"]
with open(_path, encoding="utf-8", errors="replace") as _f:
    _source = _f.read()
sys.argv = [_path]
_globals = {"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__}
del _cfg, _f, _limit
try:
    exec(compile(_source, _path, "exec"), _globals)
except SystemExit:
    raise
except MemoryError:
    try:
        sys.stdout.flush()
        traceback.print_exc(limit=-1)
        sys.stderr.flush()
    except BaseException:
        os.write(2, b"MemoryError\n")
    os._exit(MEMORY_EXIT)
except BaseException as _e:
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
""".replace("MEMORY_EXIT", str(MEMORY_EXIT))


class RunResult(NamedTuple):
    """One run's outcome. ``status``: "ok" (exit 0), "error" (another exit status, or for a
    remote service: it failed, ``stderr`` says why), "timeout" (the CPU or wall limit),
    "memory" (the code ran out of memory under its limit), "killed" (a signal, e.g. SIGSEGV
    or the file-size limit's SIGXFSZ); ``stdout``/``stderr`` truncated to the sandbox's
    ``max_output_chars`` each, saying so; ``return_code`` None when there was none;
    ``seconds`` the call's wall time, waiting for a worker excluded."""

    status: Status
    stdout: str
    stderr: str
    return_code: int | None
    seconds: float


def truncated(text: str, limit: int, total: int | None = None, *, tail: bool = False) -> str:
    """``text`` cut to ``limit`` characters with a note saying so (``total``: the size it
    had, in bytes, where only part of it was read); ``tail``: the last ones are kept (of a
    traceback, the end says what went wrong), else the first."""
    if len(text) <= limit and total is None:
        return text
    size = f"{total} bytes" if total is not None else f"{len(text)} characters"
    if tail:
        return f"[output truncated: the last {limit} characters of {size}]\n" + text[-limit:]
    return text[:limit] + f"\n[output truncated: the first {limit} characters of {size}]"


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def strip_code_fence(code: str) -> str:
    """The code of the first markdown fence in ``code`` (```` ```python ... ``` ````; ReTool
    takes the first fenced block the same way), else ``code`` itself."""
    match = _FENCE.search(code)
    return match.group(1).strip("\n") if match else code


LAST_VALUE = "_rlbus_last_value"


def print_last_expression(code: str) -> str:
    """``code`` with its last statement printed when that is a bare expression other than a
    ``print(...)`` call: ReTool's behaviour (its tool wraps the last line in ``print``), so the
    model sees a result without writing ``print``. As an interactive interpreter, a value of
    None is not printed. Code that does not parse is returned as it is (the run reports the
    SyntaxError). Lines before the expression keep their numbers (tracebacks stay right)."""
    try:
        body = ast.parse(code).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return code
    last = body[-1] if body else None
    if not isinstance(last, ast.Expr) or _is_print(last.value) or last.end_lineno is None:
        return code
    lines = code.split("\n")
    first = lines[last.lineno - 1].encode()
    end = lines[last.end_lineno - 1].encode()
    expression = ast.get_source_segment(code, last.value) or ""
    head = first[: last.col_offset].decode()
    tail = end[last.end_col_offset or 0 :].decode()
    assign = f"{head}{LAST_VALUE} = ({expression}){tail}"
    shown = f"if {LAST_VALUE} is not None: print({LAST_VALUE})"
    return "\n".join([*lines[: last.lineno - 1], assign, shown, *lines[last.end_lineno :]])


def _is_print(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
        node.func.id == "print")


Network = Literal["auto", "unshare", "audit"]

_unshare_works: bool | None = None
"""Whether ``unshare --net --map-root-user`` runs a child on this machine: probed once per
process, by the first sandbox that runs code."""


async def _probe_unshare(python: str) -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        child = await asyncio.create_subprocess_exec(
            unshare, "--net", "--map-root-user", python, "-I", "-c", "pass",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, env=dict(CHILD_ENV_KEEP))
        return await asyncio.wait_for(child.wait(), 30) == 0
    except (OSError, TimeoutError):
        return False


class CodeSandbox:
    """Runs Python code in sandboxed children, at most ``workers`` at once per event loop
    (the module's docstring says how). ``wall_s``: a run's wall-clock limit; ``cpu_s``: its
    CPU-time limit (whole seconds, rounded up); ``memory_mb``: its address space;
    ``max_output_chars``: what is kept of stdout and of stderr each. ``network``: "auto"
    (a network namespace where it works, else the audit hook), or one of them by name;
    ``python``: the interpreter (this one by default: the code sees its packages)."""

    def __init__(self, workers: int, *, wall_s: float, cpu_s: float, memory_mb: int,
                 max_output_chars: int, file_mb: int = 64, max_processes: int = 256,
                 network: Network = "auto", python: str = sys.executable) -> None:
        if workers < 1:
            raise ValueError(f"a sandbox needs at least one worker, not {workers}")
        self.workers = workers
        self.wall_s = wall_s
        self.cpu_s = max(1, int(-(-cpu_s // 1)))
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.file_mb = file_mb
        self.max_processes = max_processes
        self.network: Network = network
        self.python = python
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())

    async def network_isolation(self) -> Literal["unshare", "audit"]:
        """Which network isolation this sandbox's runs get: "unshare" (a network namespace)
        or "audit" (the audit hook, no boundary)."""
        global _unshare_works
        if self.network != "auto":
            return self.network
        if _unshare_works is None:
            _unshare_works = await _probe_unshare(self.python)
        return "unshare" if _unshare_works else "audit"

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        slot = self._slots.get(loop)
        if slot is None:
            slot = self._slots[loop] = asyncio.Semaphore(self.workers)
        return slot

    async def run(self, code: str, stdin: str = "") -> RunResult:
        """Run ``code`` as a script with ``stdin`` as its standard input; never raises for
        what the code does (cancelling the call kills the child)."""
        isolation = await self.network_isolation()
        async with self._slot():
            root = tempfile.mkdtemp(prefix="rlbus-sandbox-")
            try:
                return await self._run_in(root, code, stdin, isolation)
            finally:
                shutil.rmtree(root, ignore_errors=True)

    def _argv(self, script: str, isolation: str) -> list[str]:
        config = {
            "cpu": self.cpu_s, "as": self.memory_mb << 20, "fsize": self.file_mb << 20,
            "nproc": self.max_processes, "path": script,
            "refused": list(REFUSED_EVENTS) if isolation == "audit" else [],
        }
        argv = [self.python, "-I", "-c", _BOOTSTRAP, json.dumps(config)]
        if isolation == "unshare":
            argv = [shutil.which("unshare") or "unshare", "--net", "--map-root-user", *argv]
        return argv

    async def _run_in(self, root: str, code: str, stdin: str, isolation: str) -> RunResult:
        script, workdir = _lay_out(root, code)
        env = {**CHILD_ENV_KEEP, "HOME": workdir, "TMPDIR": workdir}
        started = time.monotonic()
        try:
            child = await asyncio.create_subprocess_exec(
                *self._argv(script, isolation), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=workdir,
                env=env, start_new_session=True)
        except OSError as e:
            return RunResult("error", "", f"the sandbox could not start Python: {e}", None,
                             time.monotonic() - started)
        return await self._supervise(child, stdin.encode(errors="replace"), started)

    async def _supervise(self, child: asyncio.subprocess.Process, stdin: bytes,
                         started: float) -> RunResult:
        cap = self.max_output_chars * 4 + 4  # bytes enough for that many UTF-8 characters
        assert child.stdout is not None and child.stderr is not None and child.stdin is not None
        out, err = _Capture(cap), _Capture(cap, tail=True)
        tasks = [asyncio.create_task(out.drain(child.stdout)),
                 asyncio.create_task(err.drain(child.stderr)),
                 asyncio.create_task(_feed(child.stdin, stdin))]
        timed_out = True  # unless it exits in time; a cancelled call kills it as well
        try:
            timed_out = not await _exited(child, self.wall_s)
        finally:
            _kill_group(child.pid)  # what the code left running, or all of it at a timeout
            await _exited(child, 10.0)  # SIGKILL: at once, on a machine that is not stuck
            await _collect(tasks, child)
        seconds = time.monotonic() - started
        status = _status(child.returncode, timed_out)
        return RunResult(status, self._text(out), self._text(err), child.returncode, seconds)

    def _text(self, capture: _Capture) -> str:
        text = capture.kept.decode(errors="replace")
        total = capture.total if capture.total > len(capture.kept) else None
        return truncated(text, self.max_output_chars, total, tail=capture.tail)


def _lay_out(root: str, code: str) -> tuple[str, str]:
    """The script (beside the working directory, not in it) and the working directory."""
    script = os.path.join(root, "code.py")
    workdir = os.path.join(root, "work")
    os.mkdir(workdir)
    with open(script, "w", encoding="utf-8", errors="replace") as f:
        f.write(code)
    return script, workdir


def _status(return_code: int | None, timed_out: bool) -> Status:
    if timed_out or return_code == -signal.SIGXCPU:
        return "timeout"
    if return_code == 0:
        return "ok"
    if return_code == MEMORY_EXIT:
        return "memory"
    if return_code is None or return_code < 0:
        return "killed"
    return "error"


async def _exited(child: asyncio.subprocess.Process, within_s: float) -> bool:
    """Whether ``child`` exited within ``within_s`` seconds. Not ``child.wait()``: on Python
    3.11 that also waits for the pipes to close, which a process the code started in a new
    session (out of reach of the group kill) may hold open indefinitely."""
    deadline = time.monotonic() + within_s
    pause = 0.005
    while child.returncode is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)
    return True


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class _Capture:
    """``cap`` bytes of a stream (its first, or its last with ``tail``) and how many it had:
    the rest is read and dropped, so a child printing without end costs no memory here. What
    was read stays when the reading is cancelled."""

    def __init__(self, cap: int, tail: bool = False) -> None:
        self.cap = cap
        self.tail = tail
        self.kept = bytearray()
        self.total = 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            self.total += len(chunk)
            if self.tail:
                self.kept = (self.kept + chunk)[-self.cap:]
            elif len(self.kept) < self.cap:
                self.kept += chunk[: self.cap - len(self.kept)]


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError, BrokenPipeError, OSError):
        if data:
            stream.write(data)
            await stream.drain()
        stream.close()
        await stream.wait_closed()


async def _collect(tasks: list[asyncio.Task[None]], child: asyncio.subprocess.Process) -> None:
    """Lets the readers and the feeder end once the child is gone. A process that left the
    group (a new session) may hold the pipes open: after a grace period the reading stops
    there (what was read is kept) and the pipes are closed."""
    _, pending = await asyncio.wait(tasks, timeout=2.0)
    for task in pending:
        task.cancel()
    if pending:
        transport = getattr(child, "_transport", None)
        if transport is not None:
            transport.close()
        await asyncio.gather(*pending, return_exceptions=True)


DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code and see what it prints (its stdout, then its stderr). "
                       "The value of a bare expression on the last line is printed.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}
"""The schema a :class:`CodeInterpreterTool` has when its configuration gives none (the name
ReTool's and verl's SandboxFusion tool use)."""


class CodeInterpreterTool:
    """ReTool's code interpreter as a tool of verl's interface: the code of ``{"code": ...}``
    (its markdown fence stripped, its last bare expression printed) run in a
    :class:`CodeSandbox` of this process, or by a SandboxFusion service when
    ``sandbox_fusion_url`` is set. The response is stdout then stderr, as verl's
    SandboxFusion tool gives them, or what stopped the run; the reward is 0.0 (the tool has
    none); the metrics are ``sandbox_s`` and 0/1 flags ``sandbox_ok``, ``sandbox_timeout``,
    ``sandbox_memory``.

    Config (verl's SandboxFusion tool's names, rlbus's last): ``sandbox_fusion_url``,
    ``num_workers`` (4), ``default_timeout`` (wall seconds, 30), ``memory_limit_mb`` (1024),
    ``default_language`` ("python"; only Python runs locally), ``cpu_timeout``
    (``default_timeout``), ``max_output_chars`` (8192 each of stdout and stderr; the agent
    loop truncates the response again)."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None) -> None:
        config = dict(config or {})
        self.config = config
        self.tool_schema = tool_schema or DEFAULT_SCHEMA
        self.name = schema_name(self.tool_schema)
        self.url = str(config.get("sandbox_fusion_url") or "")
        self.workers = int(config.get("num_workers", 4))
        self.timeout_s = float(config.get("default_timeout", 30))
        self.memory_mb = int(config.get("memory_limit_mb", 1024))
        self.language = str(config.get("default_language", "python"))
        self.cpu_s = float(config.get("cpu_timeout", self.timeout_s))
        self.max_output_chars = int(config.get("max_output_chars", 8192))
        if not self.url and self.language != "python":
            raise ValueError(f"{self.name}: default_language {self.language!r} needs a "
                             "sandbox_fusion_url; the local sandbox runs Python only")
        self._runner: Any = None  # made on first use, on the loop that calls execute

    def _make_runner(self) -> Any:
        if self.url:
            from agent.sandbox_fusion import SandboxFusionClient

            return SandboxFusionClient(
                self.url, language=self.language, run_timeout=self.timeout_s,
                memory_limit_mb=self.memory_mb, max_output_chars=self.max_output_chars,
                concurrency=self.workers)
        return CodeSandbox(self.workers, wall_s=self.timeout_s, cpu_s=self.cpu_s,
                           memory_mb=self.memory_mb, max_output_chars=self.max_output_chars)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, None]:
        return (instance_id or str(uuid.uuid4())), None

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[str, float, dict[str, float]]:
        code = parameters.get("code") if isinstance(parameters, dict) else None
        if not isinstance(code, str):
            return (f"Error: {self.name} needs the parameter \"code\" as a string of Python "
                    "code", 0.0, {"sandbox_ok": 0.0})
        if self._runner is None:
            self._runner = self._make_runner()
        code = code if self.language != "python" else print_last_expression(
            strip_code_fence(code))
        result: RunResult = await self._runner.run(code)
        return self.response(result), 0.0, _metrics(result)

    def response(self, result: RunResult) -> str:
        """What the model reads of a run: stdout then stderr (verl's SandboxFusion tool's
        response), and a line saying what stopped it where something did."""
        text = result.stdout + result.stderr
        stopped = {
            "timeout": f"Execution timed out after {self.timeout_s:g} s",
            "memory": f"Execution ran out of memory (limit {self.memory_mb} MB)",
            "killed": f"Execution was killed (exit status {result.return_code})",
        }.get(result.status)
        if stopped is not None:
            text = f"{text}\n{stopped}" if text.strip() else stopped
        return text if text else "(no output)"

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


def _metrics(result: RunResult) -> dict[str, float]:
    return {
        "sandbox_s": result.seconds,
        "sandbox_ok": float(result.status == "ok"),
        "sandbox_timeout": float(result.status == "timeout"),
        "sandbox_memory": float(result.status == "memory"),
    }
