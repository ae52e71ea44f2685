"""Kineto's "External init callback must run in same thread as registerClient" line: the
profiler agent warms torch.profiler up on the component's step thread, while torch registered
its Kineto client on the thread that imported torch. ``profiling.prepare_main_thread`` run on
that thread first makes the step thread's warm-up (and every session) silent about it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from profiling import prepare_main_thread
from runconfig import load_config

_SCRIPT = """
import sys, threading
from profiling import create_agent, prepare_main_thread
from runconfig import load_config
cfg = load_config(None, ["global_profiler.tool=torch", "run.output_dir={out}", "run.id=k"])
if sys.argv[1] == "prepare":
    assert prepare_main_thread(cfg, "cpu")
# As the trainer and the rollouter do: the agent (and its warm-up) on the step thread.
agents = []
thread = threading.Thread(target=lambda: agents.append(create_agent(cfg, "trainer", 0, "cpu")))
thread.start()
thread.join()
assert agents[0] is not None
"""

MESSAGE = "External init callback must run in same thread as registerClient"


def _run(tmp_path: Path, mode: str) -> str:
    res = subprocess.run([sys.executable, "-c", _SCRIPT.format(out=tmp_path), mode],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return res.stderr


def test_prepared_main_thread_silences_kinetos_thread_error(tmp_path: Path) -> None:
    assert MESSAGE in _run(tmp_path, "plain")  # the cause, as every component log showed it
    assert MESSAGE not in _run(tmp_path, "prepare")


@pytest.mark.parametrize("tool", ["null", "nsys"])
def test_nothing_to_prepare_without_torch_profiler(tool: str) -> None:
    cfg = load_config(None, [f"global_profiler.tool={tool}"])
    assert prepare_main_thread(cfg, "cpu") is False
