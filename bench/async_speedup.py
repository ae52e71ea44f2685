"""Async vs sync on the same long-tail workload, side by side in one run.

Both runs use `rlbus up` (embedded Redis; trainer and rollouter as separate processes, one
torch thread each on this 2-core machine) with identical model, task and batch settings; only
the async knobs differ:

- sync:  staleness_threshold=0, trigger_parameter_sync_step=1 (on-policy, the baseline);
- async: staleness_threshold=S (default 1.0), partial_rollout off.

Long tail: max_new_tokens is large and the untrained policy stops at EOS at random, so
response lengths range from 1 to max_new_tokens (batches wait for their longest response).

From the sync run's events: T_gen = mean generation time per step (the time the rollouter
spends generating one step's samples: sum of Sample.gen_time_s per batch) and T_train = mean
update time (metric trainer/update_s). The ideal speedup of overlapping them is
(T_gen + T_train) / max(T_gen, T_train); the measured speedup is the ratio of mean step times
(steady state: the first steps are excluded). Prints both and measured / ideal.

    .venv/bin/python bench/async_speedup.py [--steps 30] [--staleness 1.0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]

COMMON = [
    "trainer.ppo_mini_batch_size=8",
    "rollout.n=8",
    "rollout.max_new_tokens=48",
    "rollout.prompts_per_batch=2",
    "model.max_len=128",
    "model.d_model=128",
    "model.n_layers=3",
    "trainer.save_freq=0",
    "trainer.ppo_epochs=2",
    "task.min_digits=3",
    "task.max_digits=8",
    # An entropy-keeping temperature so lengths stay long-tailed while it learns.
    "rollout.temperature=1.0",
]


def _run(out: Path, run_id: str, steps: int, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "rlbus", "up", f"run.output_dir={out}", f"run.id={run_id}",
           f"trainer.total_training_steps={steps}", *COMMON, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{run_id} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    res = subprocess.run(
        [sys.executable, "-m", "rlbus", "inspect", "--run", run_id, "--json",
         f"run.output_dir={out}"], capture_output=True, text=True, timeout=300, check=True,
    )
    return [json.loads(line) for line in res.stdout.splitlines()]


def _step_stats(events: list[dict], skip: int) -> dict[str, float]:
    steps = [e for e in events if e["type"] == "StepFinished"][skip:]
    # Step time from consecutive StepFinished timestamps: what a user waits per step.
    ts = [e["ts"] for e in steps]
    step_s = statistics.mean(b - a for a, b in itertools.pairwise(ts))
    return {
        "step_s": step_s,
        "train_s": statistics.mean(e["metrics"]["trainer/update_s"] for e in steps),
        "idle": statistics.mean(e["metrics"]["trainer/idle_ratio"] for e in steps),
        "reward": steps[-1]["metrics"]["reward/mean"],
        "staleness": statistics.mean(e["metrics"]["staleness/mean"] for e in steps),
    }


_PROBE = (
    "import time, torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(256, 256)\n"
    "t = time.perf_counter()\n"
    "for _ in range(600): a @ a\n"
    "print(time.perf_counter() - t)\n"
)


def _contention() -> float:
    """How much slower one single-threaded torch process runs when a second one runs beside
    it (1.0 = two independent cores; ~2.0 = the two CPUs share one physical core)."""

    def timed(k: int) -> float:
        procs = [subprocess.Popen([sys.executable, "-c", _PROBE], stdout=subprocess.PIPE,
                                  text=True) for _ in range(k)]
        return statistics.mean(float(p.communicate(timeout=120)[0]) for p in procs)

    solo = min(timed(1) for _ in range(3))
    pair = min(timed(2) for _ in range(3))
    return pair / solo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the means")
    p.add_argument("--staleness", type=float, default=1.0)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp:
        out = Path(tmp)
        sync = _run(out / "sync", "sync", a.steps, [
            "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
        ])
        asyn = _run(out / "async", "async", a.steps, [
            f"async_training.staleness_threshold={a.staleness}",
            "async_training.trigger_parameter_sync_step=1",
        ])
    s, x = _step_stats(sync, a.skip), _step_stats(asyn, a.skip)
    c = _contention()
    # T_gen per step in the sync run: the rollouter's busy time is step time minus the time
    # the trainer was not waiting (update + publish), measured from the trainer's side.
    t_train = s["train_s"]
    t_gen = s["step_s"] * s["idle"]
    bound = (t_gen + t_train) / max(t_gen, t_train)
    speedup = s["step_s"] / x["step_s"]
    print(f"sync : step {s['step_s']:.3f} s  (T_gen {t_gen:.3f} s, T_train {t_train:.3f} s, "
          f"trainer idle {s['idle']:.2f}, staleness {s['staleness']:.2f})")
    print(f"async: step {x['step_s']:.3f} s  (T_train {x['train_s']:.3f} s, "
          f"trainer idle {x['idle']:.2f}, "
          f"staleness {x['staleness']:.2f})")
    print(f"speedup async/sync      {speedup:.2f}x")
    print(f"ideal overlap bound     {bound:.2f}x  = (T_gen + T_train) / max(T_gen, T_train)")
    print(f"fraction of the bound   {speedup / bound:.0%}")
    # Overlap runs generation and training at the same time; on CPUs that slow each other
    # down by c, the overlapped step cannot be shorter than c * max(T_gen, T_train).
    print(f"CPU contention factor   {c:.2f}  (two 1-thread torch processes side by side)")
    print(f"bound on this machine   {(t_gen + t_train) / (c * max(t_gen, t_train)):.2f}x"
          f"  = (T_gen + T_train) / (c * max(T_gen, T_train))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
