"""The in-process profiler agent: commands in, traces and events out (no Redis needed)."""

from __future__ import annotations

import gzip
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from profiling import (
    ProfilerAgent,
    create_agent,
    profile_root,
    safe_name,
    trace_path,
    trace_rank,
    trace_world_size,
)
from profiling import agent as agent_module
from profiling.agent import AgentEvent
from profiling.export import cut_frames
from profiling.traces import top_ops
from runconfig.schema import Config, ProfilerConfig, RolloutConfig, RunConfig
from runschema.messages import (
    ProfileStarted,
    ProfileStopped,
    StartProfile,
    StopProfile,
    WarningRaised,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def make_agent(tmp_path: Path) -> Iterator[Any]:
    """Agents built here are closed at teardown, so a failing test never leaves torch.profiler
    enabled for the next one."""
    agents: list[ProfilerAgent] = []

    def make(role: str = "trainer", rank: int = 0, **kw: Any) -> ProfilerAgent:
        agent = ProfilerAgent(role, rank, tmp_path / "run1", DEVICE, **kw)
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.close()


def start(
    sid: str,
    first: int,
    last: int,
    tool: str = "torch",
    roles: list[str] | None = None,
    ranks: list[int] | None = None,
    contents: list[str] | None = None,
) -> StartProfile:
    return StartProfile(
        session_id=sid,
        roles=["trainer", "rollouter"] if roles is None else roles,
        tool=tool,
        first_step=first,
        last_step=last,
        ranks=ranks or [],
        contents=contents or [],
    )


def work() -> None:
    a = torch.randn(32, 32, device=DEVICE)
    (a @ a).relu().sum().item()


def step(agent: ProfilerAgent, k: int) -> list[AgentEvent]:
    events = agent.step_begin(k)
    work()
    return events + agent.step_end(k)


def of(events: list[AgentEvent], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def load_trace(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def step_annotations(trace: dict[str, Any]) -> set[str]:
    return {
        e["name"]
        for e in trace["traceEvents"]
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("step:")
    }


def only_stopped(events: list[AgentEvent]) -> ProfileStopped:
    stopped = of(events, ProfileStopped)
    assert len(stopped) == 1, events
    return stopped[0]


# --------------------------------------------------------------------------- sessions


def test_single_step_session_writes_trace_and_events(make_agent: Any) -> None:
    agent = make_agent()
    assert agent.on_command(start("s1", 1, 1)) == []
    assert not agent.active

    began = agent.step_begin(1)
    assert agent.active
    work()
    ended = agent.step_end(1)
    assert not agent.active

    (started,) = of(began, ProfileStarted)
    assert (started.session_id, started.role, started.rank, started.step, started.tool) == (
        "s1",
        "trainer",
        0,
        1,
        "torch",
    )
    stopped = only_stopped(ended)
    assert stopped.status == "ok"
    assert (stopped.session_id, stopped.role, stopped.rank, stopped.tool) == (
        "s1",
        "trainer",
        0,
        "torch",
    )
    assert (stopped.first_step, stopped.last_step) == (1, 1)
    assert stopped.path == "trainer0-s1.json.gz"
    path = agent.run_dir / stopped.path
    assert path.stat().st_size == stopped.bytes > 0
    assert stopped.duration_s > 0
    assert any(op.startswith("aten::") for op in stopped.top_ops)
    assert not any(op.startswith("step:") for op in stopped.top_ops)
    assert len(stopped.top_ops) <= 10
    trace = load_trace(path)
    assert step_annotations(trace) == {"step:1"}
    # For other tools: the rank (trainer = 0), the role and the file's real path.
    assert trace["distributedInfo"] == {"rank": 0, "world_size": 1}
    assert next(iter(trace)) == "distributedInfo"
    assert trace["rlbus"]["role"] == "trainer" and trace["rlbus"]["session_id"] == "s1"
    assert trace["traceName"] == str(path.resolve())
    # Only the trace and its session view: no temp files left behind.
    files = sorted(str(p.relative_to(agent.run_dir)) for p in agent.run_dir.rglob("*"))
    assert files == ["sessions", "sessions/s1", "sessions/s1/trainer0.json.gz",
                     "trainer0-s1.json.gz"]
    assert (agent.run_dir / "sessions/s1/trainer0.json.gz").resolve() == path.resolve()


def test_continuous_session_is_one_trace(make_agent: Any) -> None:
    agent = make_agent("rollouter", 1)
    agent.on_command(start("c", 2, 3))
    assert of(step(agent, 1), ProfileStarted) == []
    events = step(agent, 2)
    assert [e.step for e in of(events, ProfileStarted)] == [2]
    assert of(events, ProfileStopped) == []
    stopped = only_stopped(step(agent, 3))
    assert (stopped.first_step, stopped.last_step, stopped.status) == (2, 3, "ok")
    assert stopped.path == "rollouter1-c.json.gz"
    assert step_annotations(load_trace(agent.run_dir / stopped.path)) == {"step:2", "step:3"}
    assert step(agent, 4) == []


def test_discrete_sessions_are_two_traces(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("d2", 2, 2))
    agent.on_command(start("d3", 3, 3))
    step(agent, 1)
    first = only_stopped(step(agent, 2))
    second = only_stopped(step(agent, 3))
    assert (first.session_id, second.session_id) == ("d2", "d3")
    assert first.path != second.path
    assert step_annotations(load_trace(agent.run_dir / first.path)) == {"step:2"}
    assert step_annotations(load_trace(agent.run_dir / second.path)) == {"step:3"}


def test_commands_for_other_roles_or_ranks_are_ignored(make_agent: Any) -> None:
    agent = make_agent("trainer", 1)
    assert agent.on_command(start("r", 1, 1, roles=["rollouter"])) == []
    assert agent.on_command(start("k", 1, 1, ranks=[0, 2])) == []
    assert agent.on_command(StopProfile(session_id="x", roles=["rollouter"])) == []
    assert agent.armed == 0
    assert step(agent, 1) == []
    assert not agent.run_dir.exists()  # nothing is created while idle

    agent.on_command(start("mine", 2, 2, roles=["trainer"], ranks=[1]))
    assert only_stopped(step(agent, 2)).status == "ok"


def test_stop_profile_ends_session_at_step_end(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("long", 1, 5))
    step(agent, 1)
    agent.step_begin(2)
    # Mid-step: stopping waits for the boundary so step 2 is whole in the trace.
    assert agent.on_command(StopProfile(session_id="long", roles=["trainer"])) == []
    assert agent.active
    work()
    stopped = only_stopped(agent.step_end(2))
    assert (stopped.first_step, stopped.last_step, stopped.status) == (1, 2, "ok")
    assert step_annotations(load_trace(agent.run_dir / stopped.path)) == {"step:1", "step:2"}
    assert step(agent, 3) == []


def test_stop_profile_between_steps_ends_at_next_begin(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("long", 1, 5))
    step(agent, 1)
    agent.on_command(StopProfile(session_id="long", roles=[]))
    events = agent.step_begin(2)
    stopped = only_stopped(events)
    assert not agent.active
    assert (stopped.first_step, stopped.last_step) == (1, 1)
    assert step_annotations(load_trace(agent.run_dir / stopped.path)) == {"step:1"}
    assert agent.step_end(2) == []


def test_stop_profile_discards_armed_session(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("later", 3, 3))
    stopped = only_stopped(agent.on_command(StopProfile(session_id="later", roles=["trainer"])))
    assert (stopped.status, stopped.path, stopped.bytes) == ("cancelled", "", 0)
    for k in (1, 2, 3):
        assert step(agent, k) == []
    # A redelivered StartProfile after its StopProfile stays cancelled.
    assert agent.on_command(start("later", 3, 3)) == []
    assert agent.armed == 0


def test_late_session_starts_at_next_boundary(make_agent: Any) -> None:
    agent = make_agent()
    step(agent, 1)
    agent.step_begin(2)
    # Arrives during step 2, asks for 1..3: steps 1 and 2 are gone, 3 is left.
    assert agent.on_command(start("late", 1, 3)) == []
    work()
    assert agent.step_end(2) == []
    events = step(agent, 3)
    assert [e.step for e in of(events, ProfileStarted)] == [3]
    stopped = only_stopped(events)
    assert (stopped.first_step, stopped.last_step, stopped.status) == (3, 3, "ok")
    assert step_annotations(load_trace(agent.run_dir / stopped.path)) == {"step:3"}


def test_session_entirely_in_the_past_is_missed(make_agent: Any) -> None:
    agent = make_agent()
    step(agent, 1)
    agent.step_begin(2)
    stopped = only_stopped(agent.on_command(start("gone", 1, 2)))
    assert (stopped.status, stopped.path, stopped.bytes) == ("missed", "", 0)
    assert (stopped.first_step, stopped.last_step) == (1, 2)
    agent.step_end(2)
    assert step(agent, 3) == []


def test_skipped_steps_make_armed_session_missed(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("s2", 2, 2))
    agent.on_command(start("s5", 4, 6))
    step(agent, 1)
    events = agent.step_begin(5)  # steps 2..4 never happen on this component
    assert only_stopped(events).session_id == "s2"
    assert only_stopped(events).status == "missed"
    assert [e.step for e in of(events, ProfileStarted)] == [5]
    work()
    agent.step_end(5)
    stopped = only_stopped(step(agent, 6))
    assert (stopped.session_id, stopped.first_step, stopped.last_step) == ("s5", 5, 6)


def test_resumed_component_reports_old_sessions_missed(make_agent: Any) -> None:
    agent = make_agent(after_step=10)
    assert only_stopped(agent.on_command(start("old", 1, 1))).status == "missed"
    agent.on_command(start("new", 11, 11))
    assert only_stopped(step(agent, 11)).status == "ok"


def test_duplicate_commands_are_ignored(make_agent: Any) -> None:
    agent = make_agent()
    cmd = start("dup", 1, 1)
    agent.on_command(cmd)
    assert agent.on_command(cmd) == []
    assert agent.armed == 1
    assert only_stopped(step(agent, 1)).status == "ok"
    # Redelivered after it finished (at-least-once): still ignored.
    assert agent.on_command(cmd) == []
    assert step(agent, 2) == []


def test_close_writes_trace_of_active_session(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("open", 1, 100))
    agent.on_command(start("future", 200, 200))
    step(agent, 1)
    agent.step_begin(2)
    work()
    # Shutdown in the middle of step 2: the finish path still runs and writes the trace.
    events = agent.close()
    by_id = {e.session_id: e for e in of(events, ProfileStopped)}
    assert by_id["open"].status == "ok"
    assert (by_id["open"].first_step, by_id["open"].last_step) == (1, 2)
    assert step_annotations(load_trace(agent.run_dir / by_id["open"].path)) == {
        "step:1",
        "step:2",
    }
    assert by_id["future"].status == "missed"
    assert not agent.active
    assert agent.close() == []
    assert agent.on_command(start("after", 3, 3)) == []
    assert agent.step_begin(3) == [] and agent.step_end(3) == []


def test_close_passes_status(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("x", 1, 3))
    step(agent, 1)
    stopped = only_stopped(agent.close(status="aborted"))
    assert stopped.status == "aborted"
    assert (agent.run_dir / stopped.path).is_file()


@pytest.mark.parametrize("sid", ["../../etc/x", "/etc/passwd", "..", "a/../../b", "x" * 500])
def test_malicious_session_id_stays_inside_run_dir(make_agent: Any, sid: str) -> None:
    agent = make_agent(role="../trainer")
    agent.on_command(start(sid, 1, 1, roles=[]))
    stopped = only_stopped(step(agent, 1))
    assert stopped.status == "ok"
    assert stopped.session_id == sid  # the event keeps the real id; only the file name is safe
    assert re.fullmatch(r"[A-Za-z0-9_.-]{1,120}", stopped.path)
    assert not stopped.path.startswith(".")
    path = (agent.run_dir / stopped.path).resolve()
    assert path.parent == agent.run_dir.resolve()
    assert path.is_file()


def test_contents_are_passed_to_torch_profiler(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("all", 1, 1, contents=["shapes", "memory", "stack"]))
    stopped = only_stopped(step(agent, 1))
    trace = load_trace(agent.run_dir / stopped.path)
    assert trace.get("record_shapes") == 1 and trace.get("profile_memory") == 1
    assert trace.get("with_stack") == 1
    assert step_annotations(trace) == {"step:1"}
    # Python frames recorded by with_stack are not ops.
    assert not any(".py(" in op for op in stopped.top_ops)


def test_commands_from_another_thread(make_agent: Any) -> None:
    agent = make_agent()
    reader = threading.Thread(target=agent.on_command, args=(start("t", 1, 1),))
    reader.start()
    reader.join(timeout=10)
    assert only_stopped(step(agent, 1)).status == "ok"


# --------------------------------------------------------------------------- tools


@pytest.mark.skipif(CUDA, reason="tests the no-CUDA fallback")
def test_torch_memory_without_cuda_warns_and_writes_cpu_trace(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("mem", 1, 1, tool="torch_memory"))
    began = agent.step_begin(1)
    (warning,) = of(began, WarningRaised)
    assert warning.code == "torch_memory_no_cuda"
    assert warning.source == "trainer0"
    assert of(began, ProfileStarted)[0].tool == "torch_memory"
    work()
    stopped = only_stopped(agent.step_end(1))
    assert (stopped.status, stopped.tool) == ("ok", "torch_memory")
    trace = load_trace(agent.run_dir / stopped.path)
    assert trace.get("profile_memory") == 1
    assert step_annotations(trace) == {"step:1"}
    assert not list(agent.run_dir.glob("*.pickle"))


@pytest.mark.skipif(CUDA, reason="tests the no-CUDA fallback")
def test_nsys_without_cuda_is_unavailable(make_agent: Any) -> None:
    agent = make_agent()
    assert agent.on_command(start("ns", 1, 2, tool="nsys")) == []
    events = agent.step_begin(1)
    assert [w.code for w in of(events, WarningRaised)] == ["nsys_no_cuda"]
    stopped = only_stopped(events)
    assert (stopped.status, stopped.path, stopped.bytes) == ("unavailable", "", 0)
    assert not agent.active
    assert agent.step_end(1) == []
    assert step(agent, 2) == []


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_torch_memory_on_cuda_writes_snapshot(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("mem", 1, 1, tool="torch_memory"))
    stopped = only_stopped(step(agent, 1))
    assert stopped.status == "ok"
    assert (agent.run_dir / "trainer0-mem.pickle").is_file()
    assert step_annotations(load_trace(agent.run_dir / stopped.path)) == {"step:1"}


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_nsys_on_cuda_is_ok_without_path(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("ns", 1, 1, tool="nsys"))
    stopped = only_stopped(step(agent, 1))
    assert (stopped.status, stopped.path) == ("ok", "")


def test_unknown_tool_and_bad_range_are_refused(make_agent: Any) -> None:
    agent = make_agent()
    events = agent.on_command(start("bad", 1, 1, tool="perf"))
    assert [w.code for w in of(events, WarningRaised)] == ["profile_bad_command"]
    assert only_stopped(events).status.startswith("error: unknown tool")
    events = agent.on_command(start("rev", 3, 2))
    assert only_stopped(events).status.startswith("error: invalid step range")
    assert step(agent, 1) == []


# --------------------------------------------------------------------------- failures


def test_failure_to_start_becomes_error_event(
    make_agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(self: object) -> None:
        raise RuntimeError("kineto exploded\nsecond line")

    agent = make_agent()
    agent.on_command(start("e", 1, 1))
    with monkeypatch.context() as m:
        m.setattr(torch.profiler.profile, "start", boom)
        events = agent.step_begin(1)
    assert [w.code for w in of(events, WarningRaised)] == ["profile_start_failed"]
    stopped = only_stopped(events)
    assert stopped.status == "error: RuntimeError: kineto exploded"
    assert not agent.active
    work()
    assert agent.step_end(1) == []
    # The component goes on, and the next session works.
    agent.on_command(start("f", 2, 2))
    assert only_stopped(step(agent, 2)).status == "ok"


def test_failure_to_write_trace_becomes_error_event(
    make_agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(self: object, path: str) -> None:
        raise OSError("disk full")

    agent = make_agent()
    agent.on_command(start("w", 1, 1))
    agent.step_begin(1)
    work()
    with monkeypatch.context() as m:
        m.setattr(torch.profiler.profile, "export_chrome_trace", boom)
        events = agent.step_end(1)
    assert [w.code for w in of(events, WarningRaised)] == ["profile_stop_failed"]
    stopped = only_stopped(events)
    assert stopped.status == "error: writing trace: OSError: disk full"
    assert (stopped.path, stopped.bytes) == ("", 0)
    assert list(agent.run_dir.iterdir()) == []  # temp files cleaned up
    agent.on_command(start("next", 2, 2))
    assert only_stopped(step(agent, 2)).status == "ok"


# --------------------------------------------------------------------------- config and paths


def test_create_agent_is_none_when_profiling_is_off(tmp_path: Path) -> None:
    off = Config(run=RunConfig(id="r1", output_dir=str(tmp_path)))
    assert create_agent(off, "trainer", 0, "cpu") is None
    on = Config(
        run=RunConfig(id="r1", output_dir=str(tmp_path)),
        global_profiler=ProfilerConfig(tool="torch"),
    )
    agent = create_agent(on, "rollouter", 2, "cpu")
    assert agent is not None
    assert agent.run_dir == tmp_path / "profiles" / "r1"
    assert (agent.role, agent.rank) == ("rollouter", 2)
    assert not agent.run_dir.exists()


def test_profile_root(tmp_path: Path) -> None:
    cfg = Config(run=RunConfig(id="run-7", output_dir="out"))
    assert profile_root(cfg) == Path("out/profiles/run-7")
    saved = Config(
        run=RunConfig(id="run-7"),
        global_profiler=ProfilerConfig(save_path=str(tmp_path / "traces")),
    )
    assert profile_root(saved) == tmp_path / "traces" / "run-7"
    assert profile_root(saved, run_id="other") == tmp_path / "traces" / "other"
    with pytest.raises(ValueError, match="run id"):
        profile_root(Config())
    with pytest.raises(ValueError, match="invalid run id"):
        profile_root(cfg, run_id="../x")


def test_safe_name_keeps_safe_ids_and_separates_unsafe_ones() -> None:
    assert safe_name("p-1_step.3") == "p-1_step.3"
    assert safe_name("a/b") != safe_name("a_b")
    assert safe_name("a/b") != safe_name("a:b")
    assert "/" not in safe_name("../../etc/x") and ".." not in safe_name("../../etc/x")
    assert len(safe_name("y" * 1000)) <= 64
    assert safe_name("") != ""


@settings(max_examples=200, deadline=None)
@given(sid=st.text(max_size=200), role=st.text(min_size=0, max_size=40))
def test_trace_path_always_inside_run_dir(sid: str, role: str) -> None:
    run_dir = Path("/tmp/rlbus-profiles/run")
    path = trace_path(run_dir, role, 3, sid, ".json.gz")
    assert path.parent == run_dir
    assert re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", path.name)
    assert len(path.name) <= 32 + 10 + 64 + 8


def test_top_ops_ranks_by_self_cpu_time_then_by_kernel_time() -> None:
    def x(name: str, cat: str, ts: float, dur: float, ext: int, tid: int = 1) -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
                "args": {"External id": ext}}  # fmt: skip

    cpu = [
        x("step:1", "user_annotation", 0, 100, 1),
        x("aten::linear", "cpu_op", 1, 60, 2),  # self 60 - 50 = 10
        x("aten::addmm", "cpu_op", 5, 50, 3),  # self 50 - 5 = 45
        x("cudaLaunchKernel", "cuda_runtime", 10, 5, 4),
        x("aten::relu", "cpu_op", 70, 20, 5),  # self 20
        x("aten::relu", "cpu_op", 0, 15, 6, tid=2),  # another thread: adds 15 -> 35
    ]
    assert top_ops({"traceEvents": cpu}) == ["aten::addmm", "aten::relu", "aten::linear"]
    assert top_ops({"traceEvents": cpu}, n=1) == ["aten::addmm"]
    kernels = [
        x("ampere_sgemm", "kernel", 20, 3, 3, tid=7),
        x("vectorized_relu", "kernel", 80, 9, 5, tid=7),
        x("orphan_kernel", "kernel", 90, 1, 99, tid=7),
    ]
    # With kernels, ops rank by the GPU time of the kernels they launched.
    assert top_ops({"traceEvents": cpu + kernels}) == [
        "aten::relu",
        "aten::addmm",
        "orphan_kernel",
    ]
    assert top_ops({}) == []


def test_step_begin_twice_closes_dangling_annotation(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("dangle", 1, 2))
    agent.step_begin(1)
    work()
    agent.step_begin(2)  # the component forgot step_end(1)
    work()
    stopped = only_stopped(agent.step_end(2))
    assert stopped.status == "ok"
    assert step_annotations(load_trace(agent.run_dir / stopped.path)) == {"step:1", "step:2"}


# --------------------------------------------------------------------------- traces for tools


def test_traces_carry_a_distinct_rank_per_role_and_replica(tmp_path: Path) -> None:
    cfg = Config(
        run=RunConfig(id="r1", output_dir=str(tmp_path)),
        global_profiler=ProfilerConfig(tool="torch"),
        rollout=RolloutConfig(replicas=3),
    )
    traces = {}
    for role, rank in (("trainer", 0), ("rollouter", 0), ("rollouter", 2)):
        agent = create_agent(cfg, role, rank, DEVICE)
        assert agent is not None
        agent.on_command(start("s1", 1, 1))
        # create_agent's exporter writes in the background: close waits for the trace.
        stopped = only_stopped(step(agent, 1) + agent.close())
        traces[(role, rank)] = load_trace(agent.run_dir / stopped.path)
    ranks = {k: t["distributedInfo"]["rank"] for k, t in traces.items()}
    assert ranks == {("trainer", 0): 0, ("rollouter", 0): 1, ("rollouter", 2): 3}
    assert {t["distributedInfo"]["world_size"] for t in traces.values()} == {4}
    assert traces[("rollouter", 2)]["rlbus"] == {
        "role": "rollouter", "replica": 2, "run_id": "r1", "session_id": "s1",
        "first_step": 1, "last_step": 1, "tool": "torch",
    }
    view = tmp_path / "profiles" / "r1" / "sessions" / "s1"
    assert sorted(p.name for p in view.iterdir()) == [
        "rollouter0.json.gz", "rollouter2.json.gz", "trainer0.json.gz"]
    for (role, rank), trace in traces.items():
        assert trace["traceName"] == str((view / f"{role}{rank}.json.gz").resolve())


def test_the_world_size_is_above_every_rank_a_joined_rollouter_included() -> None:
    assert trace_world_size(2) == 3  # the trainer and two rollouters
    # Rollouter 5 joined a run of 2 replicas (rollout.rank null: the lowest free rank).
    assert trace_world_size(2, trace_rank("rollouter", 5)) == 7
    # A session naming rank 5: every process of it, rollouter 0 and the trainer too.
    assert trace_world_size(2, trace_rank("trainer", 0), [0, 5]) == 7
    assert trace_world_size(2, trace_rank("rollouter", 0), [5]) == 7
    assert trace_world_size(4, trace_rank("rollouter", 1), [1]) == 5  # within replicas
    for replicas in range(1, 4):
        for r in range(8):
            for ranks in ([], [r], [0, 7]):
                for role, rank in (("trainer", 0), ("rollouter", r)):
                    tr = trace_rank(role, rank)
                    assert tr < trace_world_size(replicas, tr, ranks)


def test_trainer_ranks_come_first_then_the_rollouters() -> None:
    """trainer.n_gpus_per_node=4: trainer ranks 0..3 keep their rank, rollouter r is
    4 + r, and every process's world holds them all (one HTA job)."""
    got = [trace_rank("trainer", t, 4) for t in range(4)] + [
        trace_rank("rollouter", r, 4) for r in range(2)]
    assert got == [0, 1, 2, 3, 4, 5]
    assert trace_world_size(2, 0, trainers=4) == 6
    assert trace_world_size(2, trace_rank("rollouter", 5, 4), trainers=4) == 10
    assert trace_world_size(2, 3, [5], trainers=4) == 10


def test_a_joined_rollouters_trace_has_its_rank_below_the_world_size(tmp_path: Path) -> None:
    """rollout.replicas=2, rollouter rank 5 joined: the trace written by the agent the
    rollouter holds (create_agent) says rank 6 of a world of 7, and with a session naming
    rank 5 the trainer's trace says the same world size."""
    cfg = Config(
        run=RunConfig(id="r1", output_dir=str(tmp_path)),
        global_profiler=ProfilerConfig(tool="torch"),
        rollout=RolloutConfig(replicas=2),
    )
    infos = {}
    # global_profiler.ranks filters every role: [0, 5] is the trainer, rollouters 0 and 5.
    for sid, role, rank, ranks in (("every", "rollouter", 5, []),
                                   ("named", "trainer", 0, [0, 5]),
                                   ("named", "rollouter", 5, [0, 5]),
                                   ("base", "trainer", 0, [])):
        agent = create_agent(cfg, role, rank, DEVICE)
        assert agent is not None
        agent.on_command(start(sid, 1, 1, ranks=ranks))
        stopped = only_stopped(step(agent, 1) + agent.close())
        infos[(sid, role)] = load_trace(agent.run_dir / stopped.path)["distributedInfo"]
    assert infos[("every", "rollouter")] == {"rank": 6, "world_size": 7}
    assert infos[("named", "rollouter")] == {"rank": 6, "world_size": 7}
    assert infos[("named", "trainer")] == {"rank": 0, "world_size": 7}
    assert infos[("base", "trainer")] == {"rank": 0, "world_size": 3}


def test_create_agent_warms_the_profiler_up_on_its_thread(tmp_path: Path) -> None:
    cfg = Config(run=RunConfig(id="r1", output_dir=str(tmp_path)),
                 global_profiler=ProfilerConfig(tool="torch"))
    agent = create_agent(cfg, "trainer", 0, DEVICE)
    assert agent is not None
    assert agent.warm_thread == threading.get_ident()
    assert (CUDA, threading.get_ident()) in agent_module._WARMED
    assert agent.warm_up() == 0.0  # once per thread
    agent.on_command(start("s1", 1, 1))
    events = step(agent, 1) + agent.close()
    assert of(events, WarningRaised) == [] and only_stopped(events).status == "ok"


def test_a_session_on_another_thread_than_the_warm_up_says_so(tmp_path: Path) -> None:
    cfg = Config(run=RunConfig(id="r1", output_dir=str(tmp_path)),
                 global_profiler=ProfilerConfig(tool="torch"))
    agent = create_agent(cfg, "trainer", 0, DEVICE)
    assert agent is not None
    agent.on_command(start("s1", 1, 1))
    out: list[AgentEvent] = []
    worker = threading.Thread(target=lambda: out.extend(step(agent, 1)))
    worker.start()
    worker.join(timeout=60)
    out += agent.close()
    assert [w.code for w in of(out, WarningRaised)] == ["profiler_warmed_elsewhere"]
    assert only_stopped(out).status == "ok"


def test_nsys_agent_is_not_warmed_and_knows_its_command(tmp_path: Path) -> None:
    cfg = Config(run=RunConfig(id="r1", output_dir=str(tmp_path)),
                 global_profiler=ProfilerConfig(tool="nsys"))
    agent = create_agent(cfg, "rollouter", 1, "cpu")
    assert agent is not None and agent.warm_thread is None
    assert agent.nsys_command[:2] == ["nsys", "profile"]
    assert "--capture-range=cudaProfilerApi" in agent.nsys_command
    assert agent.nsys_command[-1] == f"--output={tmp_path.resolve()}/profiles/r1/rollouter1-%p"


@pytest.mark.skipif(CUDA, reason="tests the no-CUDA case")
def test_cuda_contents_without_cuda_warns_and_records_cpu(make_agent: Any) -> None:
    agent = make_agent()
    agent.on_command(start("c", 1, 1, contents=["cpu", "cuda"]))
    began = agent.step_begin(1)
    assert [w.code for w in of(began, WarningRaised)] == ["profile_no_cuda"]
    work()
    stopped = only_stopped(agent.step_end(1))
    assert stopped.status == "ok"
    assert step_annotations(load_trace(agent.run_dir / stopped.path)) == {"step:1"}


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("contents", "kernels"), [([], True), (["cuda"], True),
                                                   (["cpu"], False), (["shapes"], False)])
def test_contents_select_cuda_activity_as_verl_does(
    make_agent: Any, contents: list[str], kernels: bool
) -> None:
    agent = make_agent()
    agent.on_command(start("k", 1, 1, contents=contents))
    stopped = only_stopped(step(agent, 1))
    trace = load_trace(agent.run_dir / stopped.path)
    has_kernels = any(e.get("cat") == "kernel" for e in trace["traceEvents"])
    assert has_kernels is kernels


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_torch_memory_options_bound_the_snapshot(make_agent: Any) -> None:
    import pickle

    from runconfig.schema import GlobalToolConfig, TorchMemoryToolConfig

    tools = GlobalToolConfig(torch_memory=TorchMemoryToolConfig(
        trace_alloc_max_entries=20, stack_depth=3))
    agent = make_agent(tools=tools)
    agent.on_command(start("mem", 1, 1, tool="torch_memory"))
    agent.step_begin(1)
    for _ in range(50):
        torch.randn(256, 256, device=DEVICE).relu_()
    stopped = only_stopped(agent.step_end(1))
    assert stopped.status == "ok"
    with open(agent.run_dir / "trainer0-mem.pickle", "rb") as f:
        snap = pickle.load(f)
    traces = [e for device in snap["device_traces"] for e in device]
    assert 0 < len(traces) <= 20
    assert all(len(e.get("frames", ())) <= 3 for e in traces)


def test_memory_history_arguments_follow_verl_options() -> None:
    from runconfig.schema import GlobalToolConfig, TorchMemoryToolConfig

    tools = GlobalToolConfig(torch_memory=TorchMemoryToolConfig(
        trace_alloc_max_entries=7, stack_depth=4, context="alloc", stacks="python"))
    agent = ProfilerAgent("trainer", 0, Path("/nonexistent"), "cpu", tools=tools)
    kwargs = agent._history_kwargs()
    assert (kwargs["max_entries"], kwargs["context"], kwargs["stacks"]) == (7, "alloc", "python")
    snap = {"segments": [{"blocks": [{"frames": list(range(10))}]}],
            "device_traces": [[{"frames": list(range(6))}, {"frames": [1]}]]}
    cut_frames(snap, 4)
    assert snap["segments"][0]["blocks"][0]["frames"] == [0, 1, 2, 3]
    assert [len(e["frames"]) for e in snap["device_traces"][0]] == [4, 1]


class _FakeCudart:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def cudaProfilerStart(self) -> None:
        self.calls.append("start")

    def cudaProfilerStop(self) -> None:
        self.calls.append("stop")


@pytest.mark.parametrize(("discrete", "expected"), [
    (False, ["start", "push:1", "pop", "push:2", "pop", "stop"]),
    (True, ["start", "push:1", "pop", "stop", "start", "push:2", "pop", "stop"]),
])
def test_nsys_capture_ranges_per_session_or_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, discrete: bool, expected: list[str]
) -> None:
    # No GPU here: CUDA's profiler API and NVTX are replaced by recorders (the real calls are
    # exercised by test_nsys_on_cuda_is_ok_without_path on a CUDA machine).
    from runconfig.schema import GlobalToolConfig, NsysToolConfig

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(calls))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda n: calls.append(f"push:{n[5:]}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setenv("NSYS_PROFILING_SESSION_ID", "1")
    agent = ProfilerAgent("trainer", 0, tmp_path, "cpu",
                          tools=GlobalToolConfig(nsys=NsysToolConfig(discrete=discrete)))
    agent._cuda = True
    agent.on_command(start("ns", 1, 2, tool="nsys"))
    events = step(agent, 1) + step(agent, 2)
    assert only_stopped(events).status == "ok"
    assert calls == expected


def test_a_rollouters_profile_shows_the_tool_calls_of_its_conversations(
        make_agent: Any, tmp_path: Path) -> None:
    """With conversations (rollout.multi_turn) a rollouter's profiler records every thread:
    a tool call made on the toolbox's threads during a profiled step is a range of its
    trace, named after the tool."""
    import asyncio

    from agent.calculator import CalculatorTool
    from agent.toolbox import ToolBox
    from agent.toolcall import ToolCall
    from rollouter.conversations import _profiled

    box = ToolBox([CalculatorTool({}, None)], timeout_s=30, threads=2, span=_profiled)
    try:
        agent = make_agent(role="rollouter")
        agent.all_threads = True
        agent.on_command(start("s1", 1, 1))
        agent.step_begin(1)
        work()
        (out,) = asyncio.run(box.call_all([ToolCall("calculator", '{"expression": "6*7"}')]))
        stopped = only_stopped(agent.step_end(1))
    finally:
        box.close()
    assert out.text == "42"
    names = {e.get("name") for e in load_trace(agent.run_dir / stopped.path)["traceEvents"]}
    assert "rlbus:tool:calculator" in names and "step:1" in names
