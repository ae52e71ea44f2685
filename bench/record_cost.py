"""The run's record (``run.record``): its cost on the step time, its size, and replay speed.

Runs the demo job (``configs/demo.yaml``: embedded Redis, trainer and rollouter processes)
for ``--steps`` steps with a checkpoint every 10 (retention trims, and the record is written,
after each) with ``run.record=all`` and ``run.record=none``, interleaved ``--repeat`` times,
and compares side by side:

- the run's training throughput: finished steps per second between the first StepFinished
  after ``--skip`` and the last (the steady state; start-up excluded), and the mean
  ``timing_s/step`` over the same steps; ratio all / none (aim: the record costs <= 2%);
- the mean ``timing_s/retention`` of the steps after a checkpoint (where retention, the
  record included, is started: it runs beside the steps, so this is only its start);
- the record's CPU cost, measured alone (deterministic, unlike the A/B throughput of a
  2-core machine where both processes share the cores): the seconds of CPU to decode the
  run's samples as they come from Redis, build their rows (text decoded) and write them as
  segments, per 1 000 samples, and as a share of the machine's capacity over the time the
  run without a record took to train 1 000 samples (its cores x its seconds);
- the record's size per 1 000 samples (parquet, zstd; ``raw`` holds each sample exactly);
- ``rlbus replay --check`` over the whole run (from the config's model): its training
  seconds and wall seconds against the run's own training time (the StepFinished durations).

Run it with nothing else loading the machine.

    .venv/bin/python bench/record_cost.py [--steps 100] [--repeat 3] [--skip 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

COMMON = ["--config", "configs/demo.yaml", "trainer.save_freq=10", "trainer.logger=[]",
          "global_profiler.tool=null"]


def _run(out: Path, run_id: str, steps: int, mode: str) -> list[dict]:
    cmd = [sys.executable, "-m", "rlbus", "up", *COMMON, f"run.output_dir={out}",
           f"run.id={run_id}", f"trainer.total_training_steps={steps}", f"run.record={mode}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{run_id} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    res = subprocess.run([sys.executable, "-m", "rlbus", "inspect", "--run", run_id, "--json",
                          f"run.output_dir={out}"], capture_output=True, text=True, check=True)
    return [json.loads(line) for line in res.stdout.splitlines()]


def _stats(events: list[dict], skip: int) -> dict[str, float]:
    steps = [e for e in events if e["type"] == "StepFinished" and e["step"] > skip]
    span = steps[-1]["ts"] - steps[0]["ts"]
    checkpoint_steps = [e for e in steps if e["step"] % 10 == 1]
    return {
        "steps_per_s": (len(steps) - 1) / span,
        "step_s": statistics.fmean(e["metrics"]["timing_s/step"] for e in steps),
        "retention_s": statistics.fmean(e["metrics"].get("timing_s/retention", 0.0)
                                        for e in checkpoint_steps),
        "samples": sum(len(e["sample_ids"]) for e in events if e["type"] == "StepFinished"),
    }


def _replay(out: Path, run_id: str) -> dict[str, float]:
    began = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "rlbus", "replay", "--run", run_id, "--check",
                          f"run.output_dir={out}"], capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - began
    if res.returncode != 0:
        raise SystemExit(f"replay failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    m = re.search(r"replayed (\d+) steps in ([\d.]+) s of training \(([\d.]+) s in all\); "
                  r"the run trained them in ([\d.]+) s", res.stdout)
    assert m is not None, res.stdout
    return {"steps": int(m[1]), "train_s": float(m[2]), "all_s": float(m[3]),
            "run_train_s": float(m[4]), "wall_s": wall,
            "matched": res.stdout.count("matches weights version")}


def _record_cpu(folder: Path, model: str) -> tuple[float, int]:
    """CPU seconds to record again the samples of the segments in ``folder`` (decode their
    raw bytes, build rows, write segments), and how many."""
    import shutil

    import pyarrow.parquet as pq

    from runconfig import load_config
    from runschema.messages import decode
    from storage.record import RecordMark, read_rows, write_segment
    from trainer.record import SEGMENT_ROWS, Described, TextDecoder, _Pending, columns_of

    cfg = load_config("configs/demo.yaml", [f"model.kind={model}"])
    raws = [(r["entry_id"], r["raw"]) for r in read_rows(folder, columns=["entry_id", "raw"])]
    text = TextDecoder(cfg.model)
    text.decode([1])
    scratch = folder.parent / "record-again"
    write_segment(scratch, [], RecordMark())  # pyarrow's first write: once per process
    pq.read_schema(next(scratch.glob("*.parquet")))
    began = time.process_time()
    for i in range(0, len(raws), SEGMENT_ROWS):
        part = [_Pending(eid, decode(raw), raw, 1, "trained", "", Described("", "", ""))
                for eid, raw in raws[i:i + SEGMENT_ROWS]]
        write_segment(scratch, columns_of(part, text.decode), RecordMark())  # type: ignore[arg-type]
    spent = time.process_time() - began
    shutil.rmtree(scratch)
    return spent, len(raws)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--skip", type=int, default=5)
    a = p.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {"all": [], "none": []}
    with tempfile.TemporaryDirectory(prefix="record-bench-") as tmp:
        out = Path(tmp)
        last = ""
        for i in range(a.repeat):
            for mode in ("all", "none") if i % 2 == 0 else ("none", "all"):
                run_id = f"{mode}-{i}"
                stats = _stats(_run(out, run_id, a.steps, mode), a.skip)
                results[mode].append(stats)
                print(f"{run_id}: {stats['steps_per_s']:.2f} steps/s, step "
                      f"{stats['step_s'] * 1000:.1f} ms, retention at checkpoints "
                      f"{stats['retention_s'] * 1000:.1f} ms", flush=True)
                if mode == "all":
                    last = run_id
        folder = out / last / "record"
        size = sum(f.stat().st_size for f in folder.glob("samples-*.parquet"))
        samples = results["all"][-1]["samples"]
        replay = _replay(out, last)
        cpu_s, recorded = _record_cpu(folder, "tiny")
    best = {m: max(r["steps_per_s"] for r in rs) for m, rs in results.items()}
    median = {m: statistics.median(r["steps_per_s"] for r in rs) for m, rs in results.items()}
    step = {m: min(r["step_s"] for r in rs) for m, rs in results.items()}
    print(f"\nthroughput (best of {a.repeat}): record=all {best['all']:.2f} steps/s, "
          f"none {best['none']:.2f}: all/none {best['all'] / best['none']:.3f}; medians "
          f"{median['all']:.2f} and {median['none']:.2f}: {median['all'] / median['none']:.3f}")
    print(f"step time (best mean of {a.repeat}): all {step['all'] * 1000:.1f} ms, none "
          f"{step['none'] * 1000:.1f} ms: {100 * (step['all'] / step['none'] - 1):+.1f}%")
    print(f"retention at checkpoint steps (mean): all "
          f"{statistics.fmean(r['retention_s'] for r in results['all']) * 1000:.1f} ms, none "
          f"{statistics.fmean(r['retention_s'] for r in results['none']) * 1000:.1f} ms")
    per_1000 = cpu_s / recorded * 1000
    wall_1000 = statistics.median(1000 / (r["steps_per_s"] * r["samples"] / a.steps)
                                  for r in results["none"])
    cores = os.cpu_count() or 1
    print(f"record CPU: {per_1000 * 1000:.1f} ms per 1000 samples; the run without a record "
          f"trains 1000 samples in {wall_1000:.2f} s on {cores} cores: "
          f"{100 * per_1000 / (wall_1000 * cores):.2f}% of the machine")
    print(f"record size: {size / 1024:.0f} KiB for {int(samples)} samples: "
          f"{size / samples * 1000 / 1024:.0f} KiB per 1000 samples")
    print(f"replay --check of {replay['steps']} steps: {replay['train_s']:.2f} s training, "
          f"{replay['wall_s']:.2f} s wall; the run trained them in {replay['run_train_s']:.2f} s "
          f"({replay['matched']} publications matched)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
