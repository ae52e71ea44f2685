"""Property tests of the rollouter's profiling steps (profiling.steps), pure: no Redis, no torch.

A run's events log is generated the way the trainer writes it (any
``trigger_parameter_sync_step``, crashes mid-step and resumes included); the rollouter reads it
in arbitrary chunks (it reads between generation batches), possibly joining late, and after
each read calls :func:`follow`. Whatever the chunking:

* every step from the rollouter's first one to the run's last is begun once and ended once,
  in order, one at a time (so every scheduled step, step 1 included, is covered exactly once
  on the rollouter as on the trainer);
* step ``K`` begins at the first read that holds ``StepFinished(K-1)`` (step 1: the first
  ``WeightsPublished``), never earlier, and ends at the first read that holds
  ``StepFinished(K)``: the same stretch of the run as the trainer's step ``K``, late by at most
  one read;
* a rollouter that joins late begins with the step in progress, not with past ones.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from profiler_service.schedule import plan_sessions
from profiling.steps import Move, StepClock, current_step, follow, observe
from runconfig.schema import ProfilerConfig
from runschema.messages import (
    BlobRef,
    Event,
    ProfilerReady,
    RunFinished,
    RunStarted,
    StepFinished,
    StepStarted,
    TicketsIssued,
    TrainerResumed,
    WeightsPublished,
)

REF = BlobRef(store="redis", key="w", size=1, sha256="0")


def weights(version: int, step: int) -> WeightsPublished:
    return WeightsPublished(version=version, ref=REF, step=step)


def trainer_log(total: int, trigger: int, crashes: frozenset[int] = frozenset()) -> list[Event]:
    """The events a trainer writes for a run of ``total`` steps, in its order
    (trainer/app.py): weights v0 after ProfilerReady, then per step StepStarted, the weights
    every ``trigger`` steps, StepFinished, new tickets. A step in ``crashes`` dies after its
    StepStarted; a resumed trainer publishes its weights again and redoes the step."""
    log: list[Event] = [
        RunStarted(run_id="r", config={}),
        ProfilerReady(session_ids=[]),
        weights(0, 0),
        TicketsIssued(ticket_ids=["t"], n=1, param_version=0),
    ]
    for k in range(1, total + 1):
        log.append(StepStarted(step=k, param_version=(k - 1) // trigger))
        if k in crashes:
            log += [RunStarted(run_id="r", config={}, resumed=True),
                    TrainerResumed(step=k - 1, param_version=(k - 1) // trigger,
                                   checkpoint_step=0, replayed_steps=k - 1),
                    weights((k - 1) // trigger, k - 1),
                    StepStarted(step=k, param_version=(k - 1) // trigger)]
        if k % trigger == 0:
            log.append(weights(k // trigger, k))
        log.append(StepFinished(step=k, sample_ids=[], metrics={}, duration_s=0.1))
        if k < total:
            log.append(TicketsIssued(ticket_ids=["t"], n=1, param_version=k // trigger))
    log.append(RunFinished(run_id="r", steps=total))
    return log


def read_in_chunks(log: list[Event], cuts: list[int], total: int) -> list[tuple[int, Move]]:
    """Fold ``log`` read up to each position of ``cuts`` (ascending, the last one the log's
    end), calling :func:`follow` after each read: ``(position read up to, move)``."""
    clock = StepClock()
    done = 0
    moves: list[tuple[int, Move]] = []
    for cut in cuts:
        for msg in log[done:cut]:
            clock = observe(clock, msg)
        done = cut
        clock, new = follow(clock, total)
        moves += [(cut, m) for m in new]
    return moves


def first_at(log: list[Event], pred: object) -> int:
    """The smallest read position (entries read) that holds an entry matching ``pred``."""
    for i, msg in enumerate(log):
        if pred(msg):  # type: ignore[operator]
            return i + 1
    raise AssertionError("no such entry")


@st.composite
def runs(draw: st.DrawFn) -> tuple[int, int, frozenset[int], list[Event], list[int]]:
    total = draw(st.integers(1, 12))
    trigger = draw(st.integers(1, 5))
    crashes = frozenset(draw(st.lists(st.integers(1, total), max_size=3)))
    log = trainer_log(total, trigger, crashes)
    # Where the reads end: any positions, the log's end last; a late joiner's first read is
    # a long one.
    cuts = sorted(set(draw(st.lists(st.integers(1, len(log)), max_size=len(log)))) | {len(log)})
    return total, trigger, crashes, log, cuts


@settings(max_examples=300, deadline=None)
@given(runs())
def test_every_step_begun_and_ended_once_in_order(
    run: tuple[int, int, frozenset[int], list[Event], list[int]],
) -> None:
    total, _, _, log, cuts = run
    moves = [m for _, m in read_in_chunks(log, cuts, total)]
    # The first step: 1 for a process that read the log before the first weights, else the
    # one in progress at its first read (none once the run is over).
    at_first_read = log[: cuts[0]]
    if any(isinstance(m, WeightsPublished) for m in at_first_read):
        first = 1 + max((m.step for m in at_first_read if isinstance(m, StepFinished)),
                        default=0)
    else:
        first = 1
    # Alternating begin K / end K, K consecutive, every step from the first to the last.
    assert moves == [m for k in range(first, total + 1) for m in (("begin", k), ("end", k))]


@settings(max_examples=300, deadline=None)
@given(runs())
def test_step_k_spans_step_finished_k_minus_1_to_step_finished_k(
    run: tuple[int, int, frozenset[int], list[Event], list[int]],
) -> None:
    total, _, _, log, cuts = run
    moves = read_in_chunks(log, cuts, total)
    first_weights = first_at(log, lambda m: isinstance(m, WeightsPublished))
    for at, (kind, k) in moves:
        if kind == "begin" and k == 1:
            witness = first_weights
        elif kind == "begin":
            witness = first_at(log, lambda m, k=k: isinstance(m, StepFinished) and m.step == k - 1)
        else:
            witness = first_at(log, lambda m, k=k: isinstance(m, StepFinished) and m.step == k)
        # Never before the boundary was read, and at the first read that holds it (a late
        # joiner's first window: at its first read, which holds it).
        assert at == min(c for c in cuts if c >= witness), (kind, k, at, witness, cuts)


@settings(max_examples=200, deadline=None)
@given(runs(), st.lists(st.integers(1, 12), max_size=6), st.booleans())
def test_every_scheduled_step_is_a_rollouter_step_once(
    run: tuple[int, int, frozenset[int], list[Event], list[int]],
    steps: list[int], continuous: bool,
) -> None:
    """With the rollouter reading from the run's start (its first read before the weights),
    each step of each scheduled session, step 1 included, is begun exactly once."""
    total, _, _, log, cuts = run
    before_weights = first_at(log, lambda m: isinstance(m, WeightsPublished)) - 1
    cuts = sorted({before_weights, *cuts} - {0}) if before_weights else cuts
    moves = [m for _, m in read_in_chunks(log, cuts, total)]
    begun = [k for kind, k in moves if kind == "begin"]
    cfg = ProfilerConfig(tool="torch", steps=steps, profile_continuous_steps=continuous)
    for session in plan_sessions(cfg, 1, total):
        for k in range(session.first_step, session.last_step + 1):
            assert begun.count(k) == 1, (k, moves)


def test_t4_steps_follow_updates_not_versions() -> None:
    """trigger_parameter_sync_step=4: step 2 is the trainer's second update, not weights
    version 1 (which comes after update 4)."""
    log = trainer_log(6, 4)
    clock = StepClock()
    seen: list[tuple[str, int]] = []
    for msg in log:
        clock = observe(clock, msg)
        clock, moves = follow(clock, 6)
        for kind, k in moves:
            seen.append((kind, k))
            if kind == "begin" and k == 2:
                assert isinstance(msg, StepFinished) and msg.step == 1
            if kind == "end" and k == 2:
                assert isinstance(msg, StepFinished) and msg.step == 2
    assert seen == [m for k in range(1, 7) for m in (("begin", k), ("end", k))]
    assert current_step(clock, 6) == 0


def test_nothing_before_weights_and_nothing_past_the_last_step() -> None:
    clock = observe(StepClock(), RunStarted(run_id="r", config={}))
    clock, moves = follow(clock, 3)
    assert moves == [] and clock.from_start
    clock = observe(clock, weights(0, 0))
    clock, moves = follow(clock, 3)
    assert moves == [("begin", 1)]
    # A process started after the run's end opens nothing.
    late = StepClock()
    for msg in trainer_log(3, 1):
        late = observe(late, msg)
    assert follow(late, 3) == (late, [])
    # A run continued with more steps (RunFinished below this process's total) goes on.
    cont = StepClock()
    for msg in trainer_log(3, 1):
        cont = observe(cont, msg)
    assert follow(cont, 5)[1] == [("begin", 4)]
