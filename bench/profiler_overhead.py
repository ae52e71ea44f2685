"""Step-time overhead of the profiler agent, measured side by side in one run.

Modes, on the same small training step (an MLP with Adam):

a. ``bare``     no agent, no checks at all;
b. ``off``      profiling off as the components do it: the agent is ``None`` and the step
                loop does one non-blocking check of its local command queue;
c. ``idle``     an agent exists but has no session (step_begin/step_end every step);
d. ``profiled`` every timed step runs inside a torch.profiler session (steady state: the
                session's start and its trace export are outside the timed steps and are
                reported on their own).

Repetitions are interleaved in a shuffled order so drift (thermal, other processes) hits every
mode alike; ratios are also given as the median of per-repetition ratios.

    .venv/bin/python bench/profiler_overhead.py [--reps 30] [--steps 100] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from profiling import ProfilerAgent
from runschema.messages import StartProfile

__all__ = ["main"]

MODES = ("bare", "off", "idle", "profiled")


def make_step(device: str, width: int, batch: int) -> Callable[[], None]:
    """One optimiser step of a small MLP (forward, backward, Adam)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width),
        torch.nn.GELU(),
        torch.nn.Linear(2 * width, 2 * width),
        torch.nn.GELU(),
        torch.nn.Linear(2 * width, width),
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)
    y = torch.randn(batch, width, device=device)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()  # step time must include the GPU work

    return train_step


class Bench:
    def __init__(self, train_step: Callable[[], None], steps: int, device: str) -> None:
        self.train_step = train_step
        self.steps = steps
        self.device = device
        self.commands: deque[object] = deque()  # what a component's control reader fills
        self.tmp = Path(tempfile.mkdtemp(prefix="rlbus-bench-"))
        self.idle_agent = ProfilerAgent("trainer", 0, self.tmp / "idle", device)
        self.sessions = 0
        self.start_stop_s: list[float] = []

    def bare(self) -> float:
        step = self.train_step
        t0 = time.perf_counter()
        for _ in range(self.steps):
            step()
        return (time.perf_counter() - t0) / self.steps

    def off(self) -> float:
        step, commands = self.train_step, self.commands
        agent: ProfilerAgent | None = None  # profiling off: no agent object at all
        t0 = time.perf_counter()
        for k in range(1, self.steps + 1):
            if commands:  # one non-blocking look at the local queue
                commands.popleft()
            if agent is not None:
                agent.step_begin(k)
            step()
            if agent is not None:
                agent.step_end(k)
        return (time.perf_counter() - t0) / self.steps

    def idle(self) -> float:
        step, commands, agent = self.train_step, self.commands, self.idle_agent
        t0 = time.perf_counter()
        for k in range(1, self.steps + 1):
            if commands:
                agent.on_command(commands.popleft())
            agent.step_begin(k)
            step()
            agent.step_end(k)
        return (time.perf_counter() - t0) / self.steps

    def profiled(self) -> float:
        step = self.train_step
        self.sessions += 1
        agent = ProfilerAgent("trainer", 0, self.tmp / "profiled", self.device)
        last = self.steps + 2
        agent.on_command(
            StartProfile(
                session_id=f"b{self.sessions}",
                roles=["trainer"],
                tool="torch",
                first_step=1,
                last_step=last,
            )
        )
        # Step 1 (profiler start) and the last step (stop + export) are timed apart.
        t_start = time.perf_counter()
        agent.step_begin(1)
        t_started = time.perf_counter()
        step()
        agent.step_end(1)
        t0 = time.perf_counter()
        for k in range(2, last):
            agent.step_begin(k)
            step()
            agent.step_end(k)
        per_step = (time.perf_counter() - t0) / self.steps
        agent.step_begin(last)
        step()
        t_stop = time.perf_counter()
        events = agent.step_end(last)
        t_stopped = time.perf_counter()
        assert events and getattr(events[-1], "status", "") == "ok", events
        self.start_stop_s.append((t_started - t_start) + (t_stopped - t_stop))
        return per_step

    def close(self) -> None:
        self.idle_agent.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def bookkeeping_ns(steps: int = 200_000) -> tuple[float, float]:
    """Per-step cost of modes (b) and (c) without any training work: the noise-free figure
    behind their ratios, which on a ~1 ms step is far below run-to-run jitter."""
    commands: deque[object] = deque()
    agent: ProfilerAgent | None = None
    t0 = time.perf_counter_ns()
    for k in range(steps):
        if commands:
            commands.popleft()
        if agent is not None:
            agent.step_begin(k)
        if agent is not None:
            agent.step_end(k)
    off = (time.perf_counter_ns() - t0) / steps
    with tempfile.TemporaryDirectory() as tmp:
        idle = ProfilerAgent("trainer", 0, Path(tmp), "cpu")
        t0 = time.perf_counter_ns()
        for k in range(steps):
            if commands:
                idle.on_command(commands.popleft())
            idle.step_begin(k)
            idle.step_end(k)
        on = (time.perf_counter_ns() - t0) / steps
    empty = time.perf_counter_ns()
    for _ in range(steps):
        pass
    loop = (time.perf_counter_ns() - empty) / steps
    return off - loop, on - loop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=100, help="steps per timed block")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)

    bench = Bench(make_step(args.device, args.width, args.batch), args.steps, args.device)
    try:
        for mode in MODES:  # warm-up: allocator, kineto init (~1 s the first time)
            getattr(bench, mode)()
        bench.start_stop_s.clear()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.reps):
            order = list(MODES)
            rng.shuffle(order)
            for mode in order:
                times[mode].append(getattr(bench, mode)())
    finally:
        bench.close()

    print(
        f"device={args.device} threads={args.threads} width={args.width} batch={args.batch} "
        f"reps={args.reps} steps/block={args.steps} torch={torch.__version__}"
    )
    print(f"{'mode':<10} {'mean ms':>9} {'median ms':>10} {'min ms':>9} {'stdev ms':>9}")
    for mode in MODES:
        ts = times[mode]
        print(
            f"{mode:<10} {1e3 * statistics.fmean(ts):9.4f} {1e3 * statistics.median(ts):10.4f} "
            f"{1e3 * min(ts):9.4f} {1e3 * statistics.stdev(ts):9.4f}"
        )
    bare = statistics.fmean(times["bare"])
    for label, mode in (("(b)/(a) off", "off"), ("(c)/(a) idle", "idle"), ("(d)/(a)", "profiled")):
        paired = statistics.median(t / b for t, b in zip(times[mode], times["bare"], strict=True))
        # The ratio of minima is the least sensitive to other processes (they only add time).
        print(
            f"{label:<14} ratio of means {statistics.fmean(times[mode]) / bare:7.4f}   "
            f"median paired ratio {paired:7.4f}   "
            f"ratio of minima {min(times[mode]) / min(times['bare']):7.4f}"
        )
    off_ns, idle_ns = bookkeeping_ns()
    print(
        f"bookkeeping alone (no training step): off {off_ns:.0f} ns/step, "
        f"idle agent {idle_ns:.0f} ns/step"
    )
    print(
        f"session start+stop (incl. trace export of {args.steps + 2} steps): "
        f"mean {1e3 * statistics.fmean(bench.start_stop_s):.1f} ms"
    )


if __name__ == "__main__":
    main()
