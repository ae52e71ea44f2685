"""Trace export off the critical path (profiling.export): the step after a profiled one begins
while the trace is still being written, and ProfileStopped comes only once it is complete.

The export is made slow by a gate: ``export_chrome_trace`` waits until the test opens it, so
"before the export ends" is a fact of the test, not a timing."""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from profiling import ProfilerAgent
from profiling.export import AgentEvent, BackgroundExporter
from runschema.messages import ProfileStarted, ProfileStopped, StartProfile

GATE_S = 120.0  # only a bound on a hang: every wait below is released by the test itself


def _start(sid: str, step: int) -> StartProfile:
    return StartProfile(session_id=sid, roles=["rollouter"], tool="torch",
                        first_step=step, last_step=step)


def _work() -> None:
    a = torch.randn(32, 32)
    (a @ a).relu().sum().item()


def _stopped(events: list[AgentEvent], sid: str) -> list[ProfileStopped]:
    return [e for e in events if isinstance(e, ProfileStopped) and e.session_id == sid]


@pytest.fixture
def gated_export(monkeypatch: pytest.MonkeyPatch) -> dict[str, threading.Event]:
    """``export_chrome_trace`` that signals ``entered`` and then waits for ``open``."""
    real = torch.profiler.profile.export_chrome_trace
    gates = {"entered": threading.Event(), "open": threading.Event()}

    def slow(self: Any, path: str) -> None:
        gates["entered"].set()
        assert gates["open"].wait(GATE_S), "the test never opened the gate"
        real(self, path)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", slow)
    return gates


def test_next_step_begins_before_the_export_ends_and_stopped_follows_the_write(
    tmp_path: Path, gated_export: dict[str, threading.Event]
) -> None:
    agent = ProfilerAgent("rollouter", 0, tmp_path / "run", "cpu", run_id="r1",
                          exporter=BackgroundExporter())
    events: list[AgentEvent] = []
    try:
        for k in (1, 2):
            events += agent.on_command(_start(f"s{k}-{k}", k))
        events += agent.step_begin(1)
        _work()
        events += agent.step_end(1)
        # Step 2 begins (its own session starts) while step 1's trace is being exported.
        events += agent.step_begin(2)
        assert gated_export["entered"].wait(GATE_S)
        assert [e.session_id for e in events if isinstance(e, ProfileStarted)] == [
            "s1-1", "s2-2"]
        assert _stopped(events, "s1-1") == []
        _work()
        assert not (tmp_path / "run" / "rollouter0-s1-1.json.gz").exists()
        assert _stopped(agent.drain(), "s1-1") == []
        gated_export["open"].set()
        events += agent.step_end(2)
        # close waits for both exports; each ProfileStopped names a complete trace.
        events += agent.close()
    finally:
        gated_export["open"].set()
        agent.close()
    for sid in ("s1-1", "s2-2"):
        (stopped,) = _stopped(events, sid)
        assert stopped.status == "ok" and stopped.bytes > 0
        path = tmp_path / "run" / stopped.path
        assert path.stat().st_size == stopped.bytes
        with gzip.open(path, "rt") as fh:
            trace = json.load(fh)
        assert trace["rlbus"]["session_id"] == sid
    # Nothing half-written is left beside the traces.
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".tmp-")]


def test_stopped_comes_out_of_a_later_call_once_written(
    tmp_path: Path, gated_export: dict[str, threading.Event]
) -> None:
    agent = ProfilerAgent("rollouter", 0, tmp_path / "run", "cpu",
                          exporter=BackgroundExporter())
    try:
        agent.on_command(_start("s1-1", 1))
        agent.step_begin(1)
        _work()
        assert _stopped(agent.step_end(1), "s1-1") == []
        assert gated_export["entered"].wait(GATE_S)  # the export is under way, held
        assert _stopped(agent.drain(), "s1-1") == []
        gated_export["open"].set()
        # The export thread finishes on its own; drain (the component's pulse) reports it.
        later: list[AgentEvent] = []
        for _ in range(20_000):
            later += agent.drain()
            if later:
                break
            threading.Event().wait(0.001)
        (stopped,) = _stopped(later, "s1-1")
        assert (tmp_path / "run" / stopped.path).stat().st_size == stopped.bytes
        assert _stopped(agent.close(), "s1-1") == []  # reported once
    finally:
        gated_export["open"].set()
        agent.close()


def test_a_full_queue_makes_the_ending_step_wait_for_the_oldest_export() -> None:
    exporter = BackgroundExporter(depth=1)
    release = threading.Event()
    first_running = threading.Event()

    def slow() -> list[AgentEvent]:
        first_running.set()
        assert release.wait(GATE_S)
        return []

    def quick() -> list[AgentEvent]:
        return []

    exporter.submit(slow)
    assert first_running.wait(GATE_S)
    submitted = threading.Event()

    def second() -> None:
        exporter.submit(quick)
        submitted.set()

    thread = threading.Thread(target=second)
    thread.start()
    # The queue is full (depth 1, the first export holds it): the second submit waits.
    assert not submitted.wait(0.2)
    release.set()
    assert submitted.wait(GATE_S)
    thread.join(GATE_S)
    assert exporter.wait() == []
    exporter.close()


def test_background_exporter_reports_in_submission_order() -> None:
    exporter = BackgroundExporter(depth=2)
    stops = [ProfileStopped(session_id=f"s{k}", role="trainer", rank=0, first_step=k,
                            last_step=k, tool="torch", path="", bytes=0, duration_s=0.0)
             for k in range(3)]
    out: list[AgentEvent] = []
    for stop in stops:
        out += exporter.submit(lambda stop=stop: [stop])
    out += exporter.wait()
    assert [e.session_id for e in out if isinstance(e, ProfileStopped)] == ["s0", "s1", "s2"]
    exporter.close()
