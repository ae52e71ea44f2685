"""Turn torch's exported Chrome trace into the file other tools read (torch-free).

torch writes ``{"schemaVersion": ..., "traceEvents": [...], "traceName": "<the path it was
exported to>"}``. Without ``torch.distributed`` it writes no ``distributedInfo``, so tools that
take one trace per rank (Holistic Trace Analysis) see every file as rank 0 and keep one; and
its ``traceName`` names the temporary file the agent exported to. :func:`finish_trace` copies
the export into the final gzip file while

* inserting ``"distributedInfo": {"rank": R, "world_size": W}`` as the first key (distinct per
  role and replica, :func:`profiling.paths.trace_rank`; HTA reads the first ``"rank": N`` of a
  file), and an ``"rlbus"`` object naming the role, replica, run, session and steps;
* renaming torch's own ``distributedInfo``, if it wrote one, to ``torchDistributedInfo``;
* setting ``traceName`` to the final file's absolute path.

It streams (the head and the tail of the export are patched, the rest is copied), so a
multi-GB trace costs no more memory than a small one. :func:`top_ops` names a trace's most
expensive ops (reported with each ProfileStopped).
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from storage.files import atomic_file

__all__ = ["TOP_OPS", "finish_trace", "link_session_view", "top_ops"]

_HEAD = 1 << 16  # torch's header keys come before "traceEvents", well inside this
_TAIL = 1 << 16  # "traceName" is the last key
_CHUNK = 1 << 20
_TORCH_DIST = re.compile(rb'"distributedInfo"\s*:')
_TRACE_NAME = re.compile(rb'"traceName"\s*:\s*"(?:[^"\\]|\\.)*"')
_AFTER_EVENTS = re.compile(rb'\]\s*,\s*("traceName"\s*:\s*"(?:[^"\\]|\\.)*")')


Edit = tuple[int, int, bytes]  # (offset, bytes replaced, replacement)


def _edits(src: BinaryIO, size: int, header: bytes, trace_name: str) -> list[Edit]:
    """(offset, bytes replaced, replacement) edits of the export, in file order."""
    src.seek(0)
    head = src.read(min(size, _HEAD))
    brace = head.find(b"{")
    if brace < 0 or head[:brace].strip():
        raise ValueError("the exported trace is not a JSON object")
    name = b'"traceName": ' + json.dumps(trace_name).encode()
    edits: list[tuple[int, int, bytes]] = []
    events_at = head.find(b'"traceEvents"')
    dist = _TORCH_DIST.search(head, 0, events_at if events_at >= 0 else len(head))
    if dist is not None:
        edits.append((dist.start(), len(b'"distributedInfo"'), b'"torchDistributedInfo"'))
    # The top-level traceName: among the header keys, or right after the events array
    # (torch writes `],"traceName": "..."`); an event argument of that name is not it.
    in_head = _TRACE_NAME.search(head, 0, events_at if events_at >= 0 else len(head))
    start = max(0, size - _TAIL)
    src.seek(start)
    after_events = list(_AFTER_EVENTS.finditer(src.read()))
    if in_head is not None:
        edits.append((in_head.start(), in_head.end() - in_head.start(), name))
    elif after_events and start + after_events[-1].start(1) > events_at >= 0:
        last = after_events[-1]
        edits.append((start + last.start(1), last.end(1) - last.start(1), name))
    else:
        header += name + b", "  # none to replace: add one up front
    edits.append((brace + 1, 0, header))
    edits.sort(key=lambda e: e[0])
    for (a, n, _), (b, _, _) in itertools.pairwise(edits):
        if a + n > b:
            raise ValueError("overlapping trace edits")
    return edits


def finish_trace(
    raw: Path,
    final: Path,
    rank: int,
    world_size: int,
    metadata: Mapping[str, object],
    gzip_level: int = 6,
) -> int:
    """Write ``raw`` (torch's JSON export) to ``final`` gzipped and patched; returns its size.

    Written to a temporary file beside ``final``, fsynced, then renamed: ``final`` is either
    absent or complete.
    """
    dist = {"rank": int(rank), "world_size": int(world_size)}
    # json.dumps's default ", "/": " separators: HTA looks for '"rank":\s+N'.
    header = (
        b"\n" + b'"distributedInfo": ' + json.dumps(dist).encode() + b",\n"
        + b'"rlbus": ' + json.dumps(metadata).encode() + b",\n"
    )
    size = os.path.getsize(raw)
    with open(raw, "rb") as src, atomic_file(final) as out:
        edits = _edits(src, size, header, str(final.resolve()))
        with gzip.GzipFile(
            filename="", mode="wb", fileobj=out, compresslevel=gzip_level, mtime=0
        ) as dst:
            src.seek(0)
            pos = 0
            for offset, length, replacement in [*edits, (size, 0, b"")]:
                left = offset - pos
                while left > 0:
                    chunk = src.read(min(_CHUNK, left))
                    if not chunk:
                        raise ValueError("the exported trace changed while being copied")
                    dst.write(chunk)
                    left -= len(chunk)
                dst.write(replacement)
                src.seek(length, os.SEEK_CUR)
                pos = offset + length
    return final.stat().st_size


def link_session_view(view: Path, target: Path) -> None:
    """Make ``view`` a relative symlink to ``target`` (replacing an older link atomically)."""
    view.parent.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(target, view.parent)
    tmp = view.with_name(f".tmp-{view.name}")
    tmp.unlink(missing_ok=True)
    os.symlink(rel, tmp)
    os.replace(tmp, view)


TOP_OPS = 10
"""How many op names a ProfileStopped reports (``top_ops``)."""

_CPU_CATS = frozenset({"cpu_op", "user_annotation", "python_function", "cuda_runtime"})

# JSON as torch exports a Chrome trace (the trace, and each of its events): a value's type
# depends on its key and on the kind of event (names, numbers, nested args), so each is read
# as what its key holds.
TraceEvent = dict[str, Any]
"""One event of a Chrome trace's ``traceEvents``."""


def top_ops(trace: Mapping[str, Any], n: int = TOP_OPS) -> list[str]:
    """Names of the ``n`` most expensive ops in a Chrome trace.

    By time of the GPU kernels each op launched when the trace has kernels, else by self CPU
    time. Computed from the exported JSON: ``prof.key_averages()`` first rebuilds the whole
    event tree, ~20x slower (seconds for a 100-step session).
    """
    events = [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    cost = _kernel_cost(events, kernels) if kernels else _self_cpu_cost(events)
    ranked = sorted(cost.items(), key=lambda kv: kv[1], reverse=True)
    return [name[:200] for name, _ in ranked[:n]]


def _kernel_cost(events: list[TraceEvent], kernels: list[TraceEvent]) -> dict[str, float]:
    """Kernel time by the op that launched each kernel (matched by External id)."""
    op_by_ext: dict[object, str] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ext = (e.get("args") or {}).get("External id")
            if ext is not None:
                op_by_ext[ext] = e["name"]
    cost: dict[str, float] = {}
    for e in kernels:
        kernel: str = e["name"]
        name = op_by_ext.get((e.get("args") or {}).get("External id"), kernel)
        cost[name] = cost.get(name, 0.0) + float(e["dur"])
    return cost


def _self_cpu_cost(events: list[TraceEvent]) -> dict[str, float]:
    """Self CPU time by op: duration minus that of directly nested events on the same
    thread."""
    by_thread: dict[tuple[object, object], list[TraceEvent]] = {}
    for e in events:
        if e.get("cat") in _CPU_CATS:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    cost: dict[str, float] = {}
    for rows in by_thread.values():
        selfs = _self_times(rows)
        for e in rows:
            if e.get("cat") == "cpu_op":
                cost[e["name"]] = cost.get(e["name"], 0.0) + selfs[id(e)]
    return cost


def _self_times(rows: list[TraceEvent]) -> dict[int, float]:
    """Self time of each event of one thread (by ``id``), from a walk in start order."""
    rows.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
    stack: list[tuple[float, TraceEvent]] = []  # (end, event)
    selfs: dict[int, float] = {}
    for e in rows:
        ts, dur = float(e["ts"]), float(e["dur"])
        while stack and stack[-1][0] <= ts:
            stack.pop()
        if stack:
            parent = stack[-1][1]
            selfs[id(parent)] = selfs.get(id(parent), float(parent["dur"])) - dur
        selfs.setdefault(id(e), dur)
        stack.append((ts + dur, e))
    return selfs
