"""How long a rollouter's step boundary takes when a profiled step ends (tool=torch, steps
[1, 2], discrete: two sessions, so step 1's trace is exported at the 1 -> 2 boundary).

The rollouter's critical path at that boundary is its worker thread: it ends step 1
(``step_end(1)``), begins step 2 (``step_begin(2)``) and only then generates again. This
script drives the same agent the rollouter holds (:func:`profiling.create_agent`, role
``rollouter``) on one thread, with the rollouter's work inside each step (the default tiny
policy generating batches for ``--gen-s`` seconds), and reports:

* ``gap``: from the end of step 1's last generation batch to ``step_begin(2)`` returning
  (what the next step waits for), and its two parts, ``step_end(1)`` and ``step_begin(2)``;
* ``stopped``: from the end of step 1 to its ProfileStopped being available (the trace
  written and renamed);
* the trace's size.

    .venv/bin/python bench/profiler_export_gap.py [--reps 5] [--gen-s 2.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from policy import build_policy
from profiling import create_agent
from runconfig import load_config
from runschema.messages import ProfileStopped, StartProfile

__all__ = ["main"]


def _generate_for(policy: object, seconds: float, gen: torch.Generator) -> None:
    """Rollouter-like work: batches of 16 prompts, 16 new tokens each, for ``seconds``."""
    prompts = [[1, 2, 3, 4, 5, 6]] * 16
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        policy.generate(prompts, 16, temperature=1.0, generator=gen)  # type: ignore[attr-defined]


def _one(out: Path, gen_s: float, policy: object, gen: torch.Generator) -> dict[str, float]:
    cfg = load_config(None, ["global_profiler.tool=torch", "run.id=gap",
                             f"run.output_dir={out}"])
    agent = create_agent(cfg, "rollouter", 0, "cpu")
    assert agent is not None
    for k in (1, 2):
        agent.on_command(StartProfile(session_id=f"s{k}-{k}", roles=["rollouter"], tool="torch",
                                      first_step=k, last_step=k))
    events: list[object] = []
    events += agent.step_begin(1)
    _generate_for(policy, gen_s, gen)
    t_end = time.perf_counter()
    events += agent.step_end(1)
    t_ended = time.perf_counter()
    events += agent.step_begin(2)
    t_begin = time.perf_counter()
    stopped_at = None
    while time.perf_counter() - t_end < gen_s:
        _generate_for(policy, 0.05, gen)
        if stopped_at is None and _stopped(events, agent, 1):
            stopped_at = time.perf_counter()
    events += agent.step_end(2)
    events += agent.close()
    if stopped_at is None:
        stopped_at = time.perf_counter() if _stopped(events, agent, 1) else float("nan")
    (s1,) = [e for e in events if isinstance(e, ProfileStopped) and e.session_id == "s1-1"]
    return {"gap_s": t_begin - t_end, "step_end_s": t_ended - t_end,
            "step_begin_s": t_begin - t_ended, "stopped_s": stopped_at - t_end, "bytes": s1.bytes}


def _stopped(events: list[object], agent: object, step: int) -> bool:
    drain = getattr(agent, "drain", None)
    if drain is not None:
        events += drain()
    return any(isinstance(e, ProfileStopped) and e.session_id == f"s{step}-{step}"
               for e in events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gen-s", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    policy = build_policy({}, "cpu")
    policy.eval()  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(_one(Path(tmp), args.gen_s, policy, gen))
    for key in ("gap_s", "step_end_s", "step_begin_s", "stopped_s", "bytes"):
        values = [r[key] for r in rows]
        print(f"{key:10s} median {statistics.median(values):10.3f}  "
              f"min {min(values):10.3f}  max {max(values):10.3f}  all "
              + " ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    main()
