"""A run whose rollouter generates with vLLM (``rollout.name=vllm``), end to end: the chat
demo's model and data (``tasks.chatdemo``), trainer and rollouter as processes under
``rlbus up``, embedded Redis.

What would go wrong if the engine kept old weights after a sync: the trainer's log-probs on
the weights a step starts from would drift away from the rollout's, so
``training/rollout_probs_diff_max`` on a step whose samples were generated with exactly those
weights stays at float noise only when every publication reached the engine. The learning
rate is large on purpose: one step moves the probabilities far beyond that noise.

Skipped, with the reason printed, in a venv without vLLM (``make vllm`` installs it).
"""

from __future__ import annotations

import gzip
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from bus import Bus, RunKeys
from rollouter.engine import vllm_installed
from runschema.messages import StepStarted
from tests.procs import Procs, assert_every_step_once, events_of, run_cli
from tests.waits import event, wait_for

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.e2e,
    pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make vllm)"),
]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
CHAOS_STEPS = 12
NOISE = 2e-3  # |p_rollout - p_trainer| on equal weights: vLLM's kernels vs torch's, fp32


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tasks.chatdemo import build_demo

    return build_demo(tmp_path_factory.mktemp("vllm-demo"), n_train=64, n_val=8)


def _demo_args(demo: Path, cwd: Path) -> list[str]:
    """The chat demo's files, vLLM (eager, one device), a short run with a large lr."""
    return [
        f"data.train_files={demo / 'train.parquet'}", f"data.val_files={demo / 'val.parquet'}",
        f"actor_rollout_ref.model.path={demo / 'model'}",
        f"custom_reward_function.path={demo / 'reward.py'}",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.optim.lr=0.02",
        f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.checkpoint_contents=[model]", f"trainer.default_local_dir={cwd / 'ckpt'}",
        "async_training.require_batches=1", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    ]


def _up(demo: Path, cwd: Path, *extra: str) -> list[dict[str, Any]]:
    """``rlbus up`` on the chat demo with vLLM; the run's events (``rlbus inspect --json``)."""
    done = run_cli("up", "--config", str(ROOT / "configs" / "chat_demo.yaml"),
                   *_demo_args(demo, cwd), "trainer.logger=[console]", *extra,
                   cwd=cwd, timeout_s=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (run_dir,) = [p.parent for p in (cwd / "outputs").glob("*/config.yaml")]
    assert "generating with the vllm engine" in (run_dir / "logs" / "rollouter0.log").read_text()
    shown = run_cli("inspect", "--run", run_dir.name, "--json", cwd=cwd, timeout_s=120)
    assert shown.returncode == 0, shown.stderr
    return [json.loads(line) for line in shown.stdout.splitlines()]


def _steps(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in events if e.get("type") == "StepFinished"}


@pytest.mark.parametrize("trigger", [1, 2])
def test_a_vllm_run_trains_on_samples_from_the_weights_it_was_sent(
    demo: Path, tmp_path: Path, trigger: int,
) -> None:
    # Synchronous (staleness 0): each sample was generated with the newest weights; with
    # trigger 2 a version spans two steps, and the second trains on from moved weights.
    events = _up(demo, tmp_path, "async_training.staleness_threshold=0",
                 f"async_training.trigger_parameter_sync_step={trigger}")
    steps = _steps(events)
    assert sorted(steps) == list(range(1, STEPS + 1))
    published = [e["version"] for e in events if e.get("type") == "WeightsPublished"]
    assert published == list(range(STEPS // trigger + 1))
    for step, e in steps.items():
        metrics = e["metrics"]
        assert metrics["staleness/max"] == 0, (step, metrics)
        if (step - 1) % trigger == 0:  # the step starts from the weights its samples used
            assert metrics["training/rollout_probs_diff_max"] < NOISE, (step, metrics)
        else:  # one update away from them: the figure sees it
            assert metrics["training/rollout_probs_diff_max"] > 5 * NOISE, (step, metrics)
    assert steps[STEPS]["metrics"]["rollouter/weights_load_s"] >= 0


def test_partial_rollout_and_profiling_with_vllm(demo: Path, tmp_path: Path) -> None:
    """Partial rollout (responses resumed across syncs from the tokens so far) within the
    staleness bound, validation every 2 versions, and step 1 profiled on both roles: the
    rollouter's trace holds vLLM's own kernels (its engine core runs on the rollouter's
    worker thread)."""
    events = _up(demo, tmp_path, "async_training.partial_rollout=true",
                 "async_training.staleness_threshold=0.5", "rollout.partial_chunk_tokens=2",
                 "global_profiler.tool=torch", "global_profiler.steps=[1]",
                 "trainer.test_freq=2")
    steps = _steps(events)
    assert sorted(steps) == list(range(1, STEPS + 1))
    # Validation runs on the emptied engine between the responses it streams.
    validated = [e for e in events if e.get("type") == "ValidationFinished"]
    assert sorted(e["version"] for e in validated) == [2, 4], validated
    assert all(not e.get("error") and any(k.startswith("val-core/") for k in e["metrics"])
               for e in validated), validated
    for step, e in steps.items():
        assert e["metrics"]["staleness/max"] <= 1, (step, e["metrics"])
    # verl's global_profiler.save_path default (a verl line): outputs/profile
    (folder,) = [p.parent for p in (tmp_path / "outputs").glob("profile*/*/manifest.json")]
    sessions = json.loads((folder / "manifest.json").read_text())["sessions"]
    done = {(s["role"], s["first_step"]): s for s in sessions if s["status"] == "ok"}
    assert {("trainer", 1), ("rollouter", 1)} <= set(done), sessions
    with gzip.open(folder / done[("rollouter", 1)]["path"], "rt") as f:
        trace = f.read()
    assert "cpu_attention" in trace and "step:1" in trace


@pytest.mark.chaos
@pytest.mark.asyncio
async def test_a_killed_vllm_rollouter_is_replaced_and_nothing_is_lost_or_trained_twice(
    demo: Path, tmp_path: Path, redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys,
) -> None:
    """kill -9 of the rollouter in step 2; a new one (another vLLM engine) joins; the dead
    one's tickets are reissued once its lease runs out, and every step trains each sample
    once."""
    args = ["--config", str(ROOT / "configs" / "chat_demo.yaml"), *_demo_args(demo, tmp_path),
            f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path / 'out'}",
            "trainer.logger=[console]", "async_training.staleness_threshold=0.5",
            "heartbeat.timeout_s=6", "heartbeat.interval_s=0.5",
            f"trainer.total_training_steps={CHAOS_STEPS}"]
    procs = Procs(tmp_path / "logs")
    try:
        procs.spawn("rollouter", "rollouter", *args)
        procs.spawn("trainer", "trainer", *args)
        await wait_for(bus, run_keys.events, event(StepStarted, step=2), 600,
                       procs.watch("trainer"))
        procs.kill("rollouter", signal.SIGKILL)
        procs.spawn("rollouter-new", "rollouter", *args)
        assert procs.wait("trainer", 600) == 0, procs.log("trainer")
        assert procs.wait("rollouter-new", 120) == 0, procs.log("rollouter-new")
    finally:
        procs.kill_all()
    assert "generating with the vllm engine" in procs.log("rollouter-new")
    # Staleness 0.5 lets the killed one generate at most 1.5 steps ahead: the new one made
    # the rest.
    assert_every_step_once(await events_of(bus, run_keys.events), CHAOS_STEPS)
