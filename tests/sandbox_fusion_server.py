"""A stand-in for a SandboxFusion service in tests: an HTTP server on 127.0.0.1 (a free port,
a thread of the test's process) that speaks ``run_code`` well enough for
:mod:`agent.sandbox_fusion`'s client, running Python with a plain ``python -I -c`` child.

Paths: ``/run_code`` answers as the service does; ``/garbage`` answers 200 with text that is
not JSON; ``/error`` answers HTTP 500; ``/sandbox_error`` answers the API's SandboxError.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def run_code(request: dict[str, Any]) -> dict[str, Any]:
    """The reply of SandboxFusion's run_code for ``request`` (Python only)."""
    if request.get("language") != "python":
        return {"status": "SandboxError", "message": f"unsupported {request.get('language')}",
                "compile_result": None, "run_result": None}
    timeout = float(request.get("run_timeout") or 10)
    try:
        done = subprocess.run([sys.executable, "-I", "-c", request["code"]],
                              input=request.get("stdin") or "", capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"status": "Failed", "message": "", "compile_result": None,
                "run_result": {"status": "TimeLimitExceeded", "execution_time": timeout,
                               "return_code": None, "stdout": partial, "stderr": ""}}
    return {"status": "Success" if done.returncode == 0 else "Failed", "message": "",
            "compile_result": None,
            "run_result": {"status": "Finished", "execution_time": 0.1,
                           "return_code": done.returncode, "stdout": done.stdout,
                           "stderr": done.stderr}}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/error":
            self.send_error(500, "broken")
            return
        if self.path == "/garbage":
            self._reply(b"<html>not the API</html>")
            return
        if self.path == "/sandbox_error":
            reply = {"status": "SandboxError", "message": "no runner", "run_result": None}
        else:
            reply = run_code(json.loads(body))
        self._reply(json.dumps(reply).encode())

    def _reply(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the test reports what matters."""


@contextmanager
def serving() -> Iterator[str]:
    """The server's base URL (``http://127.0.0.1:PORT``) while it runs."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="sandbox-fusion", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
