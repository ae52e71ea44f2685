"""Torch-free profiling helpers: trace finishing for other tools, the finish hook's environment
and the nsys command line."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from profiling import hook_env, nsys_command, traces
from profiling.traces import finish_trace
from runconfig import load_config

# torch's layout: a blank-led brace, header keys, the events, then traceName last.
TORCH_LIKE = """ {
  "schemaVersion": 1,
  "deviceProperties": [],%s
  "traceEvents": [
  {"ph": "X", "cat": "user_annotation", "name": "step:1", "pid": 1, "tid": 1, "ts": 1.0,
   "dur": 5.0, "args": {"rank": 99, "traceName": "not this one"}},
  {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 2.0, "dur": 1.0}
  ],"traceName": "/tmp/.tmp-abc.json" }"""
TORCH_DIST = '\n  "distributedInfo": {"backend": "nccl", "rank": 5, "world_size": 8},'


def _finish(tmp_path: Path, text: str, **kw: Any) -> tuple[dict[str, Any], str, Path]:
    raw = tmp_path / "raw.json"
    raw.write_text(text)
    final = tmp_path / "trainer0-s1.json.gz"
    size = finish_trace(raw, final, rank=kw.pop("rank", 3), world_size=4,
                        metadata={"role": "rollouter", "replica": 2}, **kw)
    assert size == final.stat().st_size
    body = gzip.decompress(final.read_bytes()).decode()
    return json.loads(body), body, final


def test_finish_trace_adds_rank_role_and_the_real_trace_name(tmp_path: Path) -> None:
    trace, body, final = _finish(tmp_path, TORCH_LIKE % "")
    assert next(iter(trace)) == "distributedInfo"
    assert trace["distributedInfo"] == {"rank": 3, "world_size": 4}
    assert trace["rlbus"] == {"role": "rollouter", "replica": 2}
    assert trace["traceName"] == str(final.resolve())
    assert [e["name"] for e in trace["traceEvents"]] == ["step:1", "aten::mm"]
    assert trace["traceEvents"][0]["args"]["traceName"] == "not this one"
    # Holistic Trace Analysis takes the first '"rank":\s+N' of the file, line by line.
    first = next(m for line in body.splitlines() if (m := re.search(r'"rank":\s+(\d+)', line)))
    assert first.group(1) == "3"
    assert not list(tmp_path.glob(".tmp-*"))


def test_finish_trace_keeps_torch_distributed_info_under_another_name(tmp_path: Path) -> None:
    trace, _, _ = _finish(tmp_path, TORCH_LIKE % TORCH_DIST)
    assert trace["distributedInfo"] == {"rank": 3, "world_size": 4}
    assert trace["torchDistributedInfo"]["rank"] == 5


def test_finish_trace_without_a_trace_name_adds_one(tmp_path: Path) -> None:
    text = TORCH_LIKE.replace(',"traceName": "/tmp/.tmp-abc.json" }', "}") % ""
    trace, _, final = _finish(tmp_path, text)
    assert trace["traceName"] == str(final.resolve())


def test_finish_trace_streams_in_small_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    many = ",\n".join(
        json.dumps({"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1,
                    "ts": float(i), "dur": 1.0}) for i in range(2000)
    )
    text = (TORCH_LIKE % TORCH_DIST).replace(
        '"traceEvents": [\n', '"traceEvents": [\n' + many + ",\n")
    monkeypatch.setattr(traces, "_CHUNK", 7)
    monkeypatch.setattr(traces, "_HEAD", 300)
    monkeypatch.setattr(traces, "_TAIL", 200)
    trace, _, final = _finish(tmp_path, text)
    assert len(trace["traceEvents"]) == 2002
    assert trace["traceName"] == str(final.resolve())
    assert trace["torchDistributedInfo"]["rank"] == 5


def test_finish_trace_refuses_what_is_not_a_json_object(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    raw.write_text('[{"ph": "X"}]')
    with pytest.raises(ValueError, match="not a JSON object"):
        finish_trace(raw, tmp_path / "x.json.gz", 0, 1, {})
    assert not (tmp_path / "x.json.gz").exists()


def test_finish_hook_environment_has_verls_variables(tmp_path: Path) -> None:
    cfg = load_config(None, ["global_profiler.tool=nsys"])
    env = hook_env(cfg, "run-1", tmp_path / "run-1", tmp_path / "run-1/manifest.json", pid=42)
    folder = str((tmp_path / "run-1").resolve())
    assert env == {
        "RLBUS_RUN_ID": "run-1",
        "RLBUS_PROFILE_DIR": folder,
        "RLBUS_MANIFEST": f"{folder}/manifest.json",
        "VERL_PROFILE_SAVE_PATH": folder,
        "VERL_PROFILE_TOOL": "nsys",
        "VERL_PROFILE_RANK": "0",
        "VERL_PROFILE_PID": "42",
        "VERL_PROFILE_ROLE": "profiler",
        "VERL_PROFILE_RAY_NSIGHT_DIR": folder,
    }
    torch_env = hook_env(load_config(None, ["global_profiler.tool=torch"]), "r", tmp_path,
                         tmp_path / "m.json")
    assert "VERL_PROFILE_RAY_NSIGHT_DIR" not in torch_env
    assert torch_env["VERL_PROFILE_TOOL"] == "torch"


def test_nsys_command_from_worker_nsight_options(tmp_path: Path) -> None:
    options = "global_profiler.global_tool_config.nsys.worker_nsight_options"
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.id=r1", "global_profiler.tool=nsys",
                             f"{options}.capture-range-end=null", f"+{options}.sample=cpu",
                             f"{options}.cuda-memory-usage=true"])
    cmd = nsys_command(cfg, "trainer", 0)
    assert cmd == [
        "nsys", "profile", "--trace=cuda,nvtx", "--cuda-memory-usage=true",
        "--capture-range=cudaProfilerApi", "--kill=none", "--sample=cpu",
        f"--output={tmp_path.resolve()}/profiles/r1/trainer0-%p",
    ]


def test_torch_free_helpers_do_not_import_torch() -> None:
    code = ("import sys, profiling, profiling.hook, profiling.nsys, profiling.traces; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_finish_trace_replaces_a_trace_name_among_the_header_keys(tmp_path: Path) -> None:
    text = (TORCH_LIKE % '\n  "traceName": "/tmp/.tmp-head.json",').replace(
        ',"traceName": "/tmp/.tmp-abc.json" }', "}")
    trace, body, final = _finish(tmp_path, text)
    assert trace["traceName"] == str(final.resolve())
    assert body.count('"traceName"') == 2  # the top-level one and the event argument
