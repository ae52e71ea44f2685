"""``rlbus inspect --trace``'s builder (rlbus.trace.build_trace) on a hand-written log: one
track per component, spans where the log says something lasted, instants for the rest.
No Redis: the trace is a pure function of the events (and samples) it is given."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from rlbus.trace import build_trace
from runschema.messages import (
    Array,
    BlobRef,
    CheckpointSaved,
    ComponentFailed,
    Heartbeat,
    Message,
    ProfileRequest,
    ProfileRequestRefused,
    ProfilerFinished,
    ProfilerReady,
    ProfileStarted,
    ProfileStopped,
    RolloutFailed,
    RunFinished,
    RunStarted,
    Sample,
    StepFinished,
    StepStarted,
    TicketsIssued,
    TrainerResumed,
    WarningRaised,
    WeightsPublished,
)

T0 = 1_000.0


def _stop(role: str, rank: int, ts: float, path: str = "t.json.gz") -> ProfileStopped:
    return ProfileStopped(session_id="s1-1", role=role, rank=rank, first_step=1, last_step=1,
                          tool="torch", path=path, bytes=7, duration_s=0.5, ts=ts)


def _sample(rank: int, version: int, ts: float, gen: float) -> Sample:
    tokens = Array.of(np.asarray([1], dtype=np.int32))
    return Sample(sample_id=f"t{ts}/0", ticket_id=f"t{ts}", prompt_id="p", index=0, n=1,
                  prompt_tokens=tokens, response_tokens=tokens,
                  logprobs=Array.of(np.asarray([-1.0], dtype=np.float32)), reward=1.0,
                  min_version=version, max_version=version, rank=rank, gen_time_s=gen, ts=ts)


LOG: list[Message] = [
    RunStarted(run_id="r", config={}, ts=T0),
    Heartbeat(role="trainer", rank=0, pid=1, ts=T0 - 50),  # never in the trace
    ProfilerReady(session_ids=["s1-1"], ts=T0 + 0.5),
    WeightsPublished(version=0, ref=BlobRef("redis", "k", 10, "0" * 64), ts=T0 + 1),
    TicketsIssued(ticket_ids=["t0"], n=1, param_version=0, ts=T0 + 1.1),  # not drawn
    StepStarted(step=1, param_version=0, ts=T0 + 2),
    ProfileStarted(session_id="s1-1", role="trainer", rank=0, step=1, tool="torch", ts=T0 + 2),
    StepFinished(step=1, sample_ids=["a"], metrics={"critic/score/mean": 0.5, "x": math.nan},
                 duration_s=1.0, param_version=0, ts=T0 + 3),
    _stop("trainer", 0, T0 + 3),
    _stop("rollouter", 1, T0 + 3.5, path=""),  # no ProfileStarted: duration_s back from ts
    StepFinished(step=2, sample_ids=[], metrics={}, duration_s=0.25, ts=T0 + 4),  # no start
    CheckpointSaved(step=2, path="ckpt", param_version=2, ts=T0 + 4.1),
    TrainerResumed(step=2, param_version=2, checkpoint_step=2, replayed_steps=0,
                   weights_match=True, ts=T0 + 4.2),
    ProfileRequest(request_id="q", steps=[5], ts=T0 + 4.3),
    ProfileRequestRefused(request_id="q", reason="no", ts=T0 + 4.4),
    WarningRaised(source="trainer", code="w", message="m", ts=T0 + 4.5),
    ComponentFailed(role="rollouter", rank=1, error="boom", ts=T0 + 4.6),
    RolloutFailed(ticket_id="t0", rank=1, error="bad", ts=T0 + 4.7),
    ProfilerFinished(manifest_path="manifest.json", sessions=1, ts=T0 + 5),
    RunFinished(run_id="r", steps=2, ts=T0 + 6),
]


def _trace(profile_dir: Path | None = None) -> dict[str, Any]:
    samples = [_sample(0, 0, T0 + 2.0, 0.5), _sample(0, 0, T0 + 2.5, 0.5),
               _sample(0, 1, T0 + 2.2, 0.5)]
    trace = build_trace("r", LOG, samples, profile_dir)
    json.dumps(trace, allow_nan=False)  # valid JSON: no NaN anywhere
    return trace


def _named(trace: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e.get("name") == name]


def test_tracks_are_named_once_per_component() -> None:
    trace = _trace()
    processes = {e["pid"]: e["args"]["name"] for e in _named(trace, "process_name")}
    assert processes == {0: "run r", 1: "trainer", 2: "profiler service", 10: "rollouter0",
                         11: "rollouter1"}
    threads = {(e["pid"], e["tid"], e["args"]["name"]) for e in _named(trace, "thread_name")}
    assert threads == {(0, 0, "run"), (1, 1, "steps"), (1, 2, "weights and checkpoints"),
                       (1, 3, "profiling"), (11, 3, "profiling"), (2, 3, "decisions"),
                       (11, 4, "failures"), (10, 1, "generation")}
    assert trace["otherData"] == {"run_id": "r", "source": "rlbus inspect --trace",
                                  "t0_unix_s": T0 - 50}


def test_steps_are_spans_from_their_start_or_their_duration() -> None:
    trace = _trace()
    (step1,) = _named(trace, "step 1")
    assert (step1["ph"], step1["pid"], step1["tid"]) == ("X", 1, 1)
    assert (step1["ts"], step1["dur"]) == (52e6, 1e6)
    assert step1["args"]["critic/score/mean"] == 0.5 and step1["args"]["x"] is None
    assert step1["args"]["samples"] == 1
    (step2,) = _named(trace, "step 2")
    assert (step2["ts"], step2["dur"]) == (53.75e6, 0.25e6)
    rewards = [e for e in trace["traceEvents"]
               if e["ph"] == "C" and e["name"] == "critic/score/mean"]
    assert [e["args"]["critic/score/mean"] for e in rewards] == [0.5]  # step 2 has none
    staleness = [e for e in trace["traceEvents"] if e["name"] == "staleness/mean"]
    assert len(staleness) == 2


def test_profile_sessions_and_decisions(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    spans = _named(trace, "profile steps 1-1 (ok)")
    by_pid = {e["pid"]: e for e in spans}
    assert set(by_pid) == {1, 11}
    assert (by_pid[1]["ts"], by_pid[1]["dur"]) == (52e6, 1e6)  # from its ProfileStarted
    assert (by_pid[11]["ts"], by_pid[11]["dur"]) == (53e6, 0.5e6)
    assert by_pid[1]["args"]["trace"] == str(tmp_path / "t.json.gz")
    assert by_pid[11]["args"]["trace"] == ""
    decisions = [e for e in trace["traceEvents"] if e.get("pid") == 2 and e["ph"] == "i"]
    assert [e["name"] for e in decisions] == ["ProfilerReady", "ProfileRequest",
                                              "ProfileRequestRefused", "ProfilerFinished"]
    assert decisions[1]["args"] == {"request": "q", "steps": [5], "next_steps": 0,
                                    "roles": ["trainer", "rollouter"]}
    assert decisions[2]["args"] == {"request": "q", "reason": "no"}
    assert decisions[3]["args"] == {"manifest": "manifest.json", "sessions": 1}


def test_run_wide_instants_and_failures() -> None:
    trace = _trace()
    glob = [e["name"] for e in trace["traceEvents"] if e.get("s") == "g"]
    assert glob == ["RunStarted", "warning w", "rollouter1 failed",
                    "RunFinished after 2 steps (ok)"]
    trainer = [e["name"] for e in trace["traceEvents"]
               if e["pid"] == 1 and e.get("tid") == 2 and e["ph"] == "i"]
    assert trainer == ["weights v0 published", "checkpoint step 2", "resumed after step 2"]
    (failed,) = _named(trace, "rollout failed")
    assert (failed["pid"], failed["args"]) == (11, {"ticket": "t0", "error": "bad"})
    assert not _named(trace, "Heartbeat") and not _named(trace, "TicketsIssued")


def test_generation_windows_per_rollouter_and_version_never_overlap() -> None:
    gen = [e for e in _trace()["traceEvents"] if e.get("cat") == "generation"]
    assert [(e["name"], e["ts"], e["dur"], e["args"]["samples"]) for e in gen] == [
        ("generate with weights v0", 51.5e6, 1e6, 2),
        # v1's samples started at 51.7 s, inside v0's window: moved to its end.
        ("generate with weights v1", 52.5e6, 1.0, 1),
    ]
