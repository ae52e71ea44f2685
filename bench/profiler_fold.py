"""The profiler service's work per new log entry, at run lengths of 1k, 10k and 100k steps.

The service folds each new entry into its state (``state = apply(state, entry)``) and, when
the state changed, decides (``decide(cfg, state, barrier, now)``) and folds what it
publishes. This replays exactly that, without Redis, on a synthetic run: per step
StepStarted, TicketsIssued, StepFinished, WeightsPublished, a rollouter Heartbeat every 10
steps and a CheckpointSaved every 50; scheduled sessions at steps 1 and 10 and a runtime
request (``next:2``) every ``--request-every`` steps, each answered by the decisions, each
session reported by a ProfileStarted and a ProfileStopped from the trainer and two
rollouters. Sessions therefore grow with the run (1000 at 100k steps by default).

It prints, per run length, the time per entry over the whole run and over its last 10%
(the cost of a new entry late in the run; each the median of the means of blocks of 100
entries, over enough repetitions of the shorter runs to give every length about the same
number of blocks, so that preemption by other processes hardly shows), and the ratio of
the longest run's to the shortest run's: flat (about 1) means O(1) per new entry; folding
the whole log again on each entry, as the service used to, grows linearly with the run.

The sizes are measured in turn, ``--rounds`` times, so that drift hits them alike; the last
column times one fold of a whole run's log (what the old service did for every new entry).

    .venv/bin/python bench/profiler_fold.py [--steps 1000 10000 100000] [--request-every 100]
                                            [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from profiler_service.records import ServiceState
from profiler_service.schedule import decide, expected_targets
from profiler_service.state import apply, fold
from runconfig.schema import ProfilerConfig
from runschema.messages import (
    BlobRef,
    CheckpointSaved,
    Command,
    Event,
    Heartbeat,
    ProfileRequest,
    ProfileStarted,
    ProfileStopped,
    RunFinished,
    RunStarted,
    StartProfile,
    StepFinished,
    StepStarted,
    TicketsIssued,
    WeightsPublished,
)

__all__ = ["main", "replay"]

REPLICAS = 2
REFOLD_UP_TO = 10_000
"""Longest run whose whole-log refold (the old way) is timed too (it keeps every entry)."""
_REF = BlobRef(store="redis", key="w", size=1, sha256="0" * 64)


def _stops(cmd: StartProfile, step: int) -> list[Event]:
    """What the components report for ``cmd`` at ``step`` (its first or its last)."""
    out: list[Event] = []
    for role, rank in expected_targets(cmd.roles, REPLICAS, cmd.ranks):
        if step == cmd.first_step:
            out.append(ProfileStarted(session_id=cmd.session_id, role=role, rank=rank,
                                      step=step, tool=cmd.tool, ts=1.0))
        if step == cmd.last_step:
            out.append(ProfileStopped(
                session_id=cmd.session_id, role=role, rank=rank, first_step=cmd.first_step,
                last_step=cmd.last_step, tool=cmd.tool, path=f"{role}{rank}.json.gz",
                bytes=1000, duration_s=0.1, ts=1.0,
            ))
    return out


BLOCK = 100
"""Entries per timed block: a block's mean is one sample; medians of blocks shrug off the
preemptions of a shared machine."""


def replay(
    steps: int, request_every: int, keep: list[tuple[str | None, Event | Command]] | None = None
) -> tuple[int, int, list[float], list[float]]:
    """Serve a synthetic run of ``steps`` steps; ``(entries, sessions, per-block s/entry over
    the run, per-block s/entry over its last 10%)``. Only the service's work is timed (the
    synthetic entries are built outside the timer). With ``keep``, every entry folded (the
    published ones included) is appended to it."""
    cfg = ProfilerConfig(tool="torch", steps=[1, 10], roles=["trainer", "rollouter"])
    config = {"trainer": {"total_training_steps": steps}, "rollout": {"replicas": REPLICAS}}
    state = ServiceState()
    sessions: dict[int, list[StartProfile]] = {}  # step -> sessions starting or ending there
    clock_ms = 1_000_000
    blocks: list[tuple[int, float]] = []  # (step at the block's end, mean s/entry)
    block_time = 0.0
    block_entries = 0

    def serve(msg: Event | Command, entry_id: str | None) -> float:
        """The service's work for one new entry (and for what it publishes)."""
        nonlocal state
        t0 = time.perf_counter()
        before = state
        state = apply(state, msg, entry_id)
        published: list[Command | Event] = []
        if state is not before:
            published = decide(cfg, state, barrier=state.last_started_step,
                               now_ms=clock_ms if state.pending else None)
            for out in published:
                state = apply(state, out)
        elapsed = time.perf_counter() - t0
        if keep is not None:
            keep.append((entry_id, msg))
            keep.extend((None, out) for out in published)
        for out in published:  # the components' side: arm the commands (not timed)
            if isinstance(out, StartProfile):
                sessions.setdefault(out.first_step, []).append(out)
                if out.last_step != out.first_step:
                    sessions.setdefault(out.last_step, []).append(out)
        return elapsed

    entries = 0

    def feed(step: int, batch: list[Event]) -> None:
        nonlocal entries, clock_ms, block_time, block_entries
        for msg in batch:
            clock_ms += 7
            block_time += serve(msg, f"{clock_ms}-0")
            block_entries += 1
            entries += 1
            if block_entries == BLOCK:
                blocks.append((step, block_time / block_entries))
                block_time, block_entries = 0.0, 0

    feed(0, [RunStarted(run_id="bench", config=config, ts=1.0)])
    for step in range(1, steps + 1):
        reports = [r for cmd in sessions.pop(step, []) for r in _stops(cmd, step)]
        batch: list[Event] = [StepStarted(step=step, param_version=step - 1, ts=1.0)]
        batch += [r for r in reports if isinstance(r, ProfileStarted)]
        batch.append(TicketsIssued(ticket_ids=[f"t{step}"], n=4, param_version=step - 1,
                                   ts=1.0))
        if step % 10 == 0:
            batch.append(Heartbeat(role="rollouter", rank=0, pid=1, ts=1.0))
        batch.append(StepFinished(step=step, sample_ids=[f"t{step}/0"], metrics={"r": 1.0},
                                  duration_s=0.1, param_version=step - 1, ts=1.0))
        batch += [r for r in reports if isinstance(r, ProfileStopped)]
        batch.append(WeightsPublished(version=step, ref=_REF, step=step, ts=1.0))
        if step % 50 == 0:
            batch.append(CheckpointSaved(step=step, path=f"c{step}", param_version=step,
                                         ts=1.0))
        if step % request_every == 0 and step + 2 < steps:
            batch.append(ProfileRequest(request_id=f"q{step}", next_steps=2, ts=1.0))
        feed(step, batch)
    feed(steps, [RunFinished(run_id="bench", steps=steps, ts=2.0)])
    assert state.profiler_finished, "the synthetic run did not finish cleanly"
    tail_from = steps - steps // 10
    late = [mean for step, mean in blocks if step >= tail_from]
    return entries, state.sent, [mean for _, mean in blocks], late


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--request-every", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3,
                        help="the sizes are measured in turn this many times (drift hits all)")
    args = parser.parse_args(argv)
    replay(2000, args.request_every)  # warm up (imports, caches, the allocator)
    longest = max(args.steps)
    whole: dict[int, list[float]] = {s: [] for s in args.steps}
    late: dict[int, list[float]] = {s: [] for s in args.steps}
    shape: dict[int, tuple[int, int]] = {}
    for _ in range(args.rounds):
        for steps in args.steps:
            gc.collect()
            for _ in range(max(1, longest // steps // args.rounds)):
                entries, sessions, run_blocks, late_blocks = replay(steps, args.request_every)
                whole[steps] += run_blocks
                late[steps] += late_blocks
                shape[steps] = (entries, sessions)
    print(f"{'steps':>8} {'entries':>9} {'sessions':>9} {'us/entry (run)':>15} "
          f"{'us/entry (last 10%)':>20} {'refold/entry (old way)':>23}")
    for steps in args.steps:
        entries, sessions = shape[steps]
        refold = "-"
        if steps <= REFOLD_UP_TO:
            # The old service folded its whole kept log again for every new entry: late in
            # the run, that is one fold of (nearly) everything per entry.
            log: list[tuple[str | None, Event | Command]] = []
            replay(steps, args.request_every, keep=log)
            t0 = time.perf_counter()
            fold([(i, m) if i is not None else m for i, m in log])
            refold = f"{(time.perf_counter() - t0) * 1e6:.0f}"
            del log
        print(f"{steps:>8} {entries:>9} {sessions:>9} "
              f"{statistics.median(whole[steps]) * 1e6:>15.2f} "
              f"{statistics.median(late[steps]) * 1e6:>20.2f} {refold:>23}", flush=True)
    first, last = args.steps[0], args.steps[-1]
    ratio_run = statistics.median(whole[last]) / statistics.median(whole[first])
    ratio_late = statistics.median(late[last]) / statistics.median(late[first])
    print(f"ratio {last}/{first} steps: {ratio_run:.2f} per entry over the run, "
          f"{ratio_late:.2f} per entry late in the run (flat = 1; the aim is <= 1.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
