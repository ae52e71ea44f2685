"""A real run's profiled step boundary: how long each role spends between its ``step:1`` (in
trace ``s1-1``) and its ``step:2`` (in ``s2-2``) with ``tool=torch``, ``steps=[1,2]``
(discrete: step 1's trace is written at that boundary), and how much the two roles' ``step:2``
overlap.

The profiler service, one rollouter and the trainer run as processes against a throwaway
redis-server (``rlbus.redis_server.EmbeddedRedis``); the traces' absolute times (torch's
``baseTimeNanoseconds`` + ``ts``) are compared on this host's clock. Extra ``KEY=VALUE``
arguments override the defaults (small batches, 4 updates), e.g. heavier generation:

    .venv/bin/python bench/profiler_boundary_run.py [--reps 4] rollout.prompts_per_batch=16 \\
        rollout.n=32 async_training.staleness_threshold=4 trainer.ppo_epochs=4
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from rlbus.redis_server import EmbeddedRedis

__all__ = ["main"]

STEP = re.compile(r"^step:(\d+)$")
SMALL = ["trainer.ppo_mini_batch_size=4", "async_training.require_batches=1", "rollout.n=4",
         "rollout.prompts_per_batch=4", "heartbeat.interval_s=0.5", "heartbeat.timeout_s=20",
         "trainer.save_freq=0", "trainer.total_training_steps=4", "rollout.replicas=1"]
ROLES = ("rollouter0", "trainer0")


def windows(path: Path) -> dict[int, tuple[float, float]]:
    """``K -> (begin, end)`` of each ``step:K`` annotation, wall-clock seconds."""
    with gzip.open(path, "rt") as fh:
        trace = json.load(fh)
    base_us = float(trace.get("baseTimeNanoseconds", 0)) / 1e3
    out: dict[int, tuple[float, float]] = {}
    for e in trace["traceEvents"]:
        m = STEP.match(str(e.get("name", "")))
        if m and e.get("cat") == "user_annotation" and e.get("ph") == "X":
            begin = (base_us + float(e["ts"])) / 1e6
            out[int(m[1])] = (begin, begin + float(e["dur"]) / 1e6)
    return out


def one_run(extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with EmbeddedRedis(tmp / "redis", appendonly=False) as server:
            run = "gap-" + uuid.uuid4().hex[:6]
            args = [f"redis.url={server.url}", f"run.id={run}", f"run.output_dir={tmp}", *SMALL,
                    "global_profiler.tool=torch", "global_profiler.steps=[1,2]", *extra]
            procs = []
            for module in ("profiler_service", "rollouter", "trainer"):
                with (tmp / f"{module}.log").open("w") as log:
                    procs.append(subprocess.Popen([sys.executable, "-m", module, *args],
                                                  stdout=log, stderr=subprocess.STDOUT))
            for proc in procs:
                proc.wait(timeout=600)
        folder = tmp / "profiles" / run
        row: dict[str, float] = {}
        step2 = {}
        for role in ROLES:
            w1 = windows(folder / f"{role}-s1-1.json.gz")[1]
            w2 = windows(folder / f"{role}-s2-2.json.gz")[2]
            row[f"{role} gap"] = w2[0] - w1[1]
            row[f"{role} step2"] = w2[1] - w2[0]
            step2[role] = w2
        a, b = step2["rollouter0"], step2["trainer0"]
        row["step2 overlap"] = min(a[1], b[1]) - max(a[0], b[0])
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    rows = [one_run(ns.overrides) for _ in range(ns.reps)]
    for key in rows[0]:
        values = sorted(r[key] for r in rows)
        print(f"{key:18s} " + " ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    main()
