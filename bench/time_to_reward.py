"""Wall time until mean reward >= target: `rlbus up` vs an in-process synchronous GRPO loop.

Both run here, one after the other, in one invocation, with the same policy, task and
hyper-parameters (the defaults of runconfig/defaults.yaml, passed to bench/sync_grpo.py):

- rlbus: `rlbus up` (embedded Redis; rollouter and trainer as separate processes, async
  mode from the defaults), timed from launching the command until the progress line of the
  first step whose reward (critic/score/mean) >= target;
- in-process: `bench/sync_grpo.py` (generate -> reward -> update in one process), run with
  1 and with 2 torch threads, the faster counting; timed from launching it until it prints
  that it reached the target.

``--workload gen-heavy`` makes generation the larger part on both sides: one prompt's
responses per decode batch (rlbus ``rollout.prompts_per_batch=1``, the in-process loop
``--gen-prompts 1``).

Wall time from launch for both, so start-up (imports, Redis, processes) counts against
rlbus. Prints both times, the steps each needed and the ratio rlbus / in-process, and the
start-up ratio: launch to rlbus's first StepFinished (its progress line) against launch to
the in-process loop's first step. It also prints the floor of the ratio on this machine's CPUs:
rlbus with no overhead, no extra steps and the in-process start-up, its steps as short as
the in-process runs' own generation and update work allows (see ``floor_step_s``). An aim
below the floor needs more CPUs (or a GPU), not a better pipeline. Each run is stopped
completely (its whole process tree gone) before the next one starts, so no run slows the
next.

    .venv/bin/python bench/time_to_reward.py [--target 0.9] [--seeds 0 1 2]
        [--workload default|gen-heavy]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import yaml

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^step\s+(\d+)/\d+\s+reward\s+([0-9.]+)")
REACHED = re.compile(r"reached [0-9.]+ at step (\d+)")
# The in-process loop's closing line splits its time: "generate 4.1 s, update 5.2 s".
SPLIT = re.compile(r"generate ([0-9.]+) s, update ([0-9.]+) s")
# Step 1's line: rlbus up's progress line, or the in-process loop's report of step 1.
FIRST_STEP = re.compile(r"^step\s+1(/\d+)?\s+reward")


# name: (extra rlbus overrides, extra in-process arguments). gen-heavy: both sides decode one
# prompt's responses per batch (a rollout engine's small decode batches), so generation is
# the larger part of the in-process loop (seed 0, one thread: 7.2 s vs 5.2 s of update on
# 2026-12-03; 17.0 s vs 7.8 s on a slower day). bench/async_speedup.py has a workload with
# T_gen >= 2 T_train; this one must still learn the task to 0.9.
WORKLOADS: dict[str, tuple[list[str], list[str]]] = {
    "default": ([], []),
    "gen-heavy": (["rollout.prompts_per_batch=1"], ["--gen-prompts", "1"]),
}


def _defaults() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "runconfig" / "defaults.yaml").read_text())


def _watch(
    cmd: list[str], found: Any, timeout_s: float
) -> tuple[float | None, int | None, float | None]:
    """Run ``cmd``; seconds from launch until ``found(line)`` returns a step, that step, and
    seconds from launch to its first step line."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    assert proc.stdout is not None
    first: float | None = None
    try:
        for line in proc.stdout:
            if first is None and FIRST_STEP.match(line.strip()):
                first = time.perf_counter() - t0
            step = found(line)
            if step is not None:
                return time.perf_counter() - t0, step, first
            if time.perf_counter() - t0 > timeout_s:
                break
        return None, None, first
    finally:
        _stop_tree(proc)


def _stop_tree(proc: subprocess.Popen[str]) -> None:
    """Stop ``proc`` and every process it started (rlbus up's components run in sessions
    of their own): SIGTERM, then SIGKILL after a grace period; returns when all are gone."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=15)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=15)


def _rlbus(
    seed: int, target: float, out: Path, extra: list[str]
) -> tuple[float | None, int | None, float | None]:
    def found(line: str) -> int | None:
        m = STEP_LINE.match(line.strip())
        return int(m.group(1)) if m and float(m.group(2)) >= target else None

    cmd = [sys.executable, "-m", "rlbus", "up", f"run.output_dir={out}", f"run.id=ttr-{seed}",
           f"trainer.seed={seed}", f"model.seed={seed}", f"task.seed={seed}",
           f"rollout.seed={seed}", "trainer.total_training_steps=400",
           "trainer.save_freq=0", *extra]
    return _watch(cmd, found, 600)


class InProcess(NamedTuple):
    """One in-process run: time to the target, its step, time to its first step, and the
    seconds it spent generating and updating (None where it never reached the target)."""

    time_s: float | None
    step: int | None
    first_s: float | None
    gen_s: float | None
    update_s: float | None


def _in_process(seed: int, target: float, threads: int, extra: list[str]) -> InProcess:
    d = _defaults()
    t, r, m, k = d["trainer"], d["rollout"], d["model"], d["task"]
    ac = d["async_training"]
    split: list[float] = []

    def found(line: str) -> int | None:
        m = REACHED.search(line)
        if m and (s := SPLIT.search(line)):
            split.extend(float(x) for x in s.groups())
        return int(m.group(1)) if m else None

    cmd = [sys.executable, str(ROOT / "bench" / "sync_grpo.py"), "--seed", str(seed),
           "--target", str(target), "--steps", "400", "--threads", str(threads),
           "--min-digits", str(k["min_digits"]), "--max-digits", str(k["max_digits"]),
           "--d-model", str(m["d_model"]), "--layers", str(m["n_layers"]),
           "--heads", str(m["n_heads"]),
           "--prompts", str(t["ppo_mini_batch_size"] * ac["require_batches"]),
           "--updates", str(ac["require_batches"] * t["ppo_epochs"]),
           "--n", str(r["n"]), "--lr", str(t["lr"]), "--temperature", str(r["temperature"]),
           "--max-new-tokens", str(r["max_new_tokens"]),
           "--clip-low", str(t["clip_ratio_low"]), "--clip-high", str(t["clip_ratio_high"]),
           "--grad-clip", str(t["grad_clip"]), "--entropy-coef", str(t["entropy_coeff"]),
           "--kl-guard", str(t["kl_guard"] or 0), "--zero-adv", str(t["zero_adv"]),
           "--quiet", *extra]
    time_s, step, first_s = _watch(cmd, found, 600)
    gen_s, update_s = split or (None, None)
    return InProcess(time_s, step, first_s, gen_s, update_s)


def work_per_step(one: InProcess, two: InProcess) -> tuple[float, float, float] | None:
    """Seconds per step of the in-process runs' own work: generation and update on one
    thread (G1, T1), and the update on two threads (T2); None if a run missed the target."""
    if (one.step is None or one.gen_s is None or one.update_s is None or two.step is None
            or two.update_s is None):
        return None
    return one.gen_s / one.step, one.update_s / one.step, two.update_s / two.step


def floor_step_s(g1: float, t1: float, t2: float, cpus: int, replicas: int) -> float:
    """The shortest step any rlbus layout could take on ``cpus`` CPUs.

    rlbus runs the same generation and update code as the in-process loop, so it does at
    least that work per step. A trainer on one thread beside ``replicas`` one-thread
    rollouters needs max(T1, G1/replicas, (G1 + T1)/cpus); a trainer on two threads keeps
    both busy for T2, so max(T2, (2 T2 + G1)/cpus). The floor is the smaller of the two:
    no overhead, no waiting, no extra steps."""
    return min(max(t1, g1 / replicas, (g1 + t1) / cpus), max(t2, (2 * t2 + g1) / cpus))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--workload", choices=list(WORKLOADS), default="default")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra overrides for the rlbus run only (e.g. async knobs)")
    a = p.parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    replicas = next((int(kv.split("=", 1)[1]) for kv in a.set
                     if kv.startswith("rollout.replicas=")), _defaults()["rollout"]["replicas"])
    ours, theirs, starts, floors = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="rlbus-ttr-") as tmp:
        for seed in a.seeds:
            # The baseline gets its better thread count (small matmuls often run slower on
            # two threads than on one).
            ours_extra, theirs_extra = WORKLOADS[a.workload]
            one, two = (_in_process(seed, a.target, threads, theirs_extra) for threads in (1, 2))
            best = min((one, two), key=lambda r: float("inf") if r.time_s is None else r.time_s)
            t_up, s_up, first_up = _rlbus(seed, a.target, Path(tmp) / f"s{seed}",
                                          [*ours_extra, *a.set])
            print(f"seed {seed}: rlbus up {_fmt(t_up)} (step {s_up}, first step at "
                  f"{_fmt(first_up)})   in-process sync {_fmt(best.time_s)} (step {best.step}, "
                  f"first step at {_fmt(best.first_s)}, {1 + (best is two)} thread(s))",
                  flush=True)
            if best.time_s is not None and t_up is not None:
                ours.append(t_up)
                theirs.append(best.time_s)
                work = work_per_step(one, two)
                if work is not None and best.first_s is not None and best.step is not None:
                    floor = floor_step_s(*work, cpus, replicas)
                    # Start-up as fast as the in-process loop's, every later step at the floor.
                    floors.append(best.first_s + (best.step - 1) * floor)
                    g1, t1, t2 = (1e3 * x for x in work)
                    print(f"    work per step: generate {g1:.0f} ms, update {t1:.0f} ms on one "
                          f"thread, {t2:.0f} ms on two; floor step on {cpus} CPUs "
                          f"{1e3 * floor:.0f} ms", flush=True)
            if first_up is not None and best.first_s is not None:
                starts.append(first_up / best.first_s)
    if starts:
        print(f"start-up: launch to first step, rlbus / in-process {statistics.mean(starts):.2f}"
              f" (per seed: {', '.join(f'{x:.2f}' for x in starts)})")
    if not ours:
        print("no seed reached the target in both setups")
        return 1
    ratio = statistics.mean(ours) / statistics.mean(theirs)
    print(f"mean time to reward >= {a.target}: rlbus {statistics.mean(ours):.1f} s, "
          f"in-process {statistics.mean(theirs):.1f} s, ratio rlbus/in-process {ratio:.2f}")
    if len(floors) == len(ours):
        floor_ratio = statistics.mean(floors) / statistics.mean(theirs)
        print(f"floor of that ratio on {cpus} CPUs: {floor_ratio:.2f} (rlbus with no "
              "overhead, no extra steps and the in-process loop's start-up)")
    return 0


def _fmt(t: float | None) -> str:
    return "never" if t is None else f"{t:6.1f} s"


if __name__ == "__main__":
    raise SystemExit(main())
