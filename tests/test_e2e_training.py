"""End-to-end training runs: trainer and rollouters as real processes against a real Redis."""

from __future__ import annotations

import json
import math
import signal
from collections import Counter
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runschema.messages import (
    ComponentFailed,
    DeadLetter,
    PromptTicket,
    RolloutFailed,
    RunFinished,
    RunStarted,
    Sample,
    StepFinished,
    StepStarted,
    TrainerResumed,
    WarningRaised,
    WeightsPublished,
)
from tests.procs import FAST, Procs, events_of, run_cli
from tests.waits import event, wait_for
from trainer.budget import max_staleness, ticket_budget
from trainer.timing import PHASES

REQUIRED_METRICS = (
    "critic/score/mean",
    "staleness/mean",
    "staleness/max",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/grad_norm",
    "trainer/idle_ratio",
    "trainer/update_s",
    "trainer/loop_cpu_s",
    "rollouter/idle_ratio",
    "samples/queue_depth",
    "throughput/samples_per_s",
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_std",
)


def _args(redis_url: str, run_id: str, out: Path, *extra: str) -> list[str]:
    # retention=all: these tests read every sample back (trimming is tested in test_faults).
    return [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={out}", *FAST,
            "run.retention=all", *extra]


@pytest.fixture
def procs(tmp_path: Path):
    p = Procs(tmp_path / "logs")
    yield p
    p.kill_all()


def _start(procs: Procs, args: list[str], replicas: int = 1) -> None:
    """Rollouter replicas, then the trainer, as real processes."""
    for rank in range(replicas):
        procs.spawn(f"rollouter{rank}", "rollouter", *args, f"rollout.rank={rank}")
    procs.spawn("trainer", "trainer", *args)


def _finish(procs: Procs, replicas: int = 1, trainer: str = "trainer") -> None:
    """The trainer and every rollouter exit 0 (the run finished)."""
    assert procs.wait(trainer, 180) == 0, procs.log(trainer)
    for rank in range(replicas):
        assert procs.wait(f"rollouter{rank}", 60) == 0, procs.log(f"rollouter{rank}")
    for name in (trainer, *(f"rollouter{rank}" for rank in range(replicas))):
        # No native teardown noise after a component's last line (triton's, with vLLM).
        assert "nanobind" not in procs.log(name), procs.log(name)[-2000:]


async def _samples(bus: Bus, keys: RunKeys) -> dict[str, Sample]:
    out: dict[str, Sample] = {}
    async for _, msg in bus.read_all(keys.samples):
        if isinstance(msg, Sample):
            out[msg.sample_id] = msg
    return out


def _finished(events: list) -> list[StepFinished]:
    return [e for e in events if isinstance(e, StepFinished)]


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_two_rollouters_train_every_sample_once_within_staleness(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps, threshold = 6, 0.5
    args = _args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 f"async_training.staleness_threshold={threshold}", "rollout.replicas=2")
    _start(procs, args, replicas=2)
    _finish(procs, replicas=2)

    events = await events_of(bus, run_keys.events)
    finished = _finished(events)
    assert [e.step for e in finished] == list(range(1, steps + 1))
    # One RunFinished, for every step, after the last StepFinished.
    (run_finished,) = [e for e in events if isinstance(e, RunFinished)]
    assert run_finished.steps == steps
    assert events.index(run_finished) > events.index(finished[-1])

    # Every trained sample id appears exactly once, and each step has full prompt groups.
    trained = [sid for e in finished for sid in e.sample_ids]
    assert len(trained) == len(set(trained))
    assert all(len(e.sample_ids) == 4 * 4 for e in finished)

    samples = await _samples(bus, run_keys)
    bound = max_staleness(threshold, 1, 1, 4)
    budget = ticket_budget(threshold, 1, 1, 4)
    fresh = 0
    for e in finished:
        version = e.step - 1  # trigger_parameter_sync_step=1: step k trains with version k-1
        for sid in e.sample_ids:
            s = samples[sid]
            assert 0 <= version - s.min_version <= bound, (sid, s.min_version, version)
            assert s.min_version <= s.max_version
        by_ticket = Counter(samples[sid].ticket_id for sid in e.sample_ids)
        assert set(by_ticket.values()) == {4}
        for key in REQUIRED_METRICS:
            assert key in e.metrics, key
            assert math.isfinite(e.metrics[key]), (key, e.metrics[key])
        assert e.metrics["tickets/outstanding"] <= budget
        assert e.metrics["staleness/max"] <= bound
        if e.metrics["staleness/max"] == 0:
            # Every sample from the weights the step starts from: the rollout's and the
            # trainer's probabilities differ by float noise only.
            fresh += 1
            assert e.metrics["training/rollout_probs_diff_max"] < 1e-4, e.metrics
        # Where the step's time went: the worker's update and the event loop's CPU.
        assert e.metrics["trainer/update_s"] > 0
        assert 0 < e.metrics["trainer/loop_cpu_s"] < 60
    assert fresh >= 1  # step 1 at least: its samples all come from version 0
    # The step windows tile the run (trainer.timing): each step's laps add up to its
    # timing_s/step, and the windows of steps 2..n add up to the time between StepFinished
    # 1 and n (the time the trainer stamped on them), within 5%.
    for e in finished:
        laps = [v for k, v in e.metrics.items() if k.startswith("timing_s/") and k[9:] in PHASES]
        assert len(laps) == len(PHASES) and min(laps) >= 0, e.metrics
        assert sum(laps) == pytest.approx(e.metrics["timing_s/step"], rel=1e-6)
        assert e.metrics["timing_s/wait_update"] + e.metrics["timing_s/read_samples"] > 0
    windows = sum(e.metrics["timing_s/step"] for e in finished[1:])
    assert windows == pytest.approx(finished[-1].ts - finished[0].ts, rel=0.05)
    # Weight sync into the rollouters' engines, timed (after several loads, a pulse told it).
    last = finished[-1].metrics
    assert 0 <= last["rollouter/weights_load_s"] <= last["rollouter/weights_sync_s"] < 60
    # Both replicas generated.
    assert {samples[sid].rank for sid in trained} == {0, 1}
    # No more tickets were ever issued than the budget allows beyond what was trained.
    tickets = [m async for _, m in bus.read_all(run_keys.prompts)]
    assert all(isinstance(t, PromptTicket) for t in tickets)
    assert len(tickets) <= steps * 4 + budget
    # Weights: version 0 plus one per step.
    published = [e for e in events if isinstance(e, WeightsPublished)]
    assert [e.version for e in published] == list(range(steps + 1))
    # Old weight blobs are deleted; the newest ones stay readable.
    kept = [await bus.exists(f"{e.ref.key}:0") for e in published]
    assert kept == [False] * (steps + 1 - 3) + [True] * 3, kept


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_sync_mode_trains_only_on_policy_samples(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps = 4
    args = _args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "async_training.staleness_threshold=0",
                 "async_training.trigger_parameter_sync_step=1",
                 "async_training.partial_rollout=false")
    _start(procs, args)
    _finish(procs)
    events = await events_of(bus, run_keys.events)
    samples = await _samples(bus, run_keys)
    finished = _finished(events)
    assert len(finished) == steps
    for e in finished:
        assert e.metrics["staleness/max"] == 0.0
        for sid in e.sample_ids:
            s = samples[sid]
            # Generated entirely by the weights the trainer held at that step.
            assert s.min_version == s.max_version == e.step - 1
    # Tickets issued for a step never exceed one step's worth: the synchronous baseline.
    assert all(e.metrics["tickets/outstanding"] <= 4 for e in finished)


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_partial_rollout_records_version_span(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    args = _args(redis_url, run_id, tmp_path, "trainer.total_training_steps=4",
                 "async_training.partial_rollout=true", "async_training.staleness_threshold=1",
                 "rollout.partial_chunk_tokens=1")
    _start(procs, args)
    _finish(procs)
    events = await events_of(bus, run_keys.events)
    samples = await _samples(bus, run_keys)
    bound = max_staleness(1.0, 1, 1, 4)
    for e in _finished(events):
        for sid in e.sample_ids:
            s = samples[sid]
            assert s.min_version <= s.max_version <= e.step - 1
            assert e.step - 1 - s.min_version <= bound


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_trainer_without_rollouter_fails_loudly(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    args = _args(redis_url, run_id, tmp_path, "heartbeat.timeout_s=3")
    procs.spawn("trainer", "trainer", *args)
    assert procs.wait("trainer", 60) == 1
    assert "no rollouter" in procs.log("trainer")
    failed = await wait_for(bus, run_keys.events, event(ComponentFailed), 5)
    assert isinstance(failed, ComponentFailed) and "no rollouter" in failed.error


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_rollouter_without_trainer_fails_loudly(
    redis_url: str, run_id: str, tmp_path: Path, procs: Procs
) -> None:
    args = _args(redis_url, run_id, tmp_path, "heartbeat.timeout_s=3")
    procs.spawn("rollouter0", "rollouter", *args)
    assert procs.wait("rollouter0", 60) == 1
    assert "no trainer" in procs.log("rollouter0")


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.asyncio
async def test_killed_rollouter_tickets_are_reclaimed(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps = 6
    args = _args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "rollout.replicas=2", "heartbeat.timeout_s=4")
    _start(procs, args, replicas=2)
    await wait_for(bus, run_keys.events, event(StepStarted, step=2), 120, procs.watch("trainer"))
    procs.kill("rollouter1", signal.SIGKILL)
    assert procs.wait("trainer", 180) == 0, procs.log("trainer")
    events = await events_of(bus, run_keys.events)
    trained = [sid for e in _finished(events) for sid in e.sample_ids]
    assert len(_finished(events)) == steps
    assert len(trained) == len(set(trained))


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.asyncio
async def test_killed_trainer_resumes_with_the_same_model(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps = 8
    args = _args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "trainer.save_freq=3", "heartbeat.timeout_s=15")
    _start(procs, args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=5), 120, procs.watch("trainer"))
    procs.kill("trainer", signal.SIGKILL)
    procs.spawn("trainer2", "trainer", *args)
    assert procs.wait("trainer2", 180) == 0, procs.log("trainer2")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    events = await events_of(bus, run_keys.events)
    finished = _finished(events)
    steps_done = [e.step for e in finished]
    assert sorted(set(steps_done)) == list(range(1, steps + 1))
    trained = [sid for e in {e.step: e for e in finished}.values() for sid in e.sample_ids]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert any(isinstance(e, RunStarted) and e.resumed for e in events)
    resumed = [e for e in events if isinstance(e, TrainerResumed)]
    assert len(resumed) == 1 and resumed[0].step >= 5
    # The rebuilt model hashes to the weights the dead trainer had published.
    assert resumed[0].weights_match is True
    assert resumed[0].checkpoint_step == 3 and resumed[0].replayed_steps == resumed[0].step - 3
    codes = [e.code for e in events if isinstance(e, WarningRaised)]
    assert "resume_weights_mismatch" not in codes


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_rlbus_up_and_inspect_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    up = run_cli("up", f"run.output_dir={out}", "run.id=demo-e2e", *FAST,
                 "trainer.total_training_steps=3", timeout_s=240)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "step    3/3" in up.stdout
    assert "rlbus inspect --run demo-e2e" in up.stdout
    assert (out / "demo-e2e" / "checkpoints").is_dir()
    res = run_cli("inspect", "--run", "demo-e2e", "--json", f"run.output_dir={out}")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    types = [r["type"] for r in rows]
    assert "RunStarted" in types and types.index("RunStarted") < types.index("RunFinished")
    steps = [r for r in rows if r["type"] == "StepFinished"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(len(r["sample_ids"]) == 16 and "critic/score/mean" in r["metrics"] for r in steps)
    png = tmp_path / "metrics.png"
    res = run_cli("inspect", "--run", "demo-e2e", "--plot", str(png), f"run.output_dir={out}")
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "StepFinished" not in res.stdout  # --plot writes the plot only


@pytest.mark.procs
@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["trainer", "trainer.total_training_steps=abc"], "trainer.total_training_steps"),
        (["rollouter", "rollout.n=0"], "rollout.n"),
        (["up", "async_training.staleness_threshold=-1"], "async_training.staleness_threshold"),
        (["up", "trainer.no_such_key=1"], "trainer.no_such_key"),
        (["up", "--config", "/nonexistent.yaml"], "--config"),
        (["inspect", "--run", "x", "run.output_dir=[1]"], "run.output_dir"),
        (["rollouter", "rollout.rank=-3"], "rollout.rank"),
    ],
)
def test_bad_config_exits_2_naming_the_key(argv: list[str], key: str) -> None:
    res = run_cli(*argv, timeout_s=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert key in res.stderr, res.stderr


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_failing_tickets_are_dead_lettered_and_replaced(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps = 4
    args = _args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "task.reward_fn=tests.rewards_for_tests:fail_on_nines")
    _start(procs, args)
    _finish(procs)
    events = await events_of(bus, run_keys.events)
    failed = [e for e in events if isinstance(e, RolloutFailed)]
    assert failed and all("verifier crashed" in e.error for e in failed)
    dead = [m async for _, m in bus.read_all(run_keys.dlq)]
    dead_tickets = {m.entry_id for m in dead if isinstance(m, DeadLetter)
                    and m.source_stream == run_keys.prompts}
    assert dead_tickets, "failing tickets should end in the dead-letter stream"
    assert any(isinstance(e, WarningRaised) and e.code == "tickets_dead_lettered" for e in events)
    samples = await _samples(bus, run_keys)
    trained = [samples[sid] for e in _finished(events) for sid in e.sample_ids]
    assert len(_finished(events)) == steps
    # Healthy batch-mates of a failing prompt were trained; no failing prompt was.
    tickets = {t.ticket_id: t async for _, t in _tickets(bus, run_keys)}
    assert any(t.answer.startswith("9") for t in tickets.values())
    assert not any(tickets[s.ticket_id].answer.startswith("9") for s in trained)


async def _tickets(bus: Bus, keys: RunKeys):
    async for entry_id, msg in bus.read_all(keys.prompts):
        if isinstance(msg, PromptTicket):
            yield entry_id, msg


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_rollouts_that_always_fail_stop_the_run_loudly(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    args = _args(redis_url, run_id, tmp_path, "task.reward_fn=tests.rewards_for_tests:always_fail")
    _start(procs, args)
    assert procs.wait("trainer", 120) == 1
    assert "rollouts keep failing" in procs.log("trainer")
    assert "verifier is down" in procs.log("trainer")
