"""A rollouter killed in the middle of its conversations (rollout.multi_turn), with real
processes on a real Redis: the agent demo's warmed-up model, whose every response calls the
calculator, here a calculator that takes a second to answer, so that the kill lands while
conversations wait on it. The tickets of the dead replica are answered by another one; the
run finishes with every step once and no sample trained twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runschema.messages import Sample, StepFinished, TicketsClaimed
from tests.procs import Procs, assert_every_step_once, events_of, run_args
from tests.waits import event, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]
ROOT = Path(__file__).resolve().parents[1]
STEPS = 4

SLOW_CALCULATOR = '''"""The calculator, a second late: a conversation waits on each call."""
import asyncio

from agent.calculator import CalculatorTool


class SlowCalculator(CalculatorTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(1.0)
        return await super().execute(instance_id, parameters, **kwargs)
'''


async def test_a_rollouter_killed_mid_conversation_loses_no_ticket_and_trains_none_twice(
        redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path,
        procs: Procs) -> None:
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from tasks.agentdemo import SCHEMA, build_demo

    files = build_demo(tmp_path / "agentdemo", n_train=64, n_val=8, hidden=64,
                       warmup_steps=120)
    (tmp_path / "slow_calc.py").write_text(SLOW_CALCULATOR)
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: slow_calc.py:SlowCalculator\n    config: {}\n"
        f"    tool_schema: {json.dumps(SCHEMA)}\n")
    args = ["--config", str(ROOT / "configs" / "agent_demo.yaml"),
            *run_args(redis_url, run_id, tmp_path / "out",
                      f"data.train_files={files / 'train.parquet'}", "data.val_files=null",
                      "trainer.val_before_train=false", "trainer.test_freq=-1",
                      f"custom_reward_function.path={files / 'reward.py'}",
                      f"actor_rollout_ref.model.path={files / 'model'}",
                      f"actor_rollout_ref.rollout.multi_turn.tool_config_path="
                      f"{tmp_path / 'tools.yaml'}",
                      f"trainer.total_training_steps={STEPS}", "trainer.logger=[console]",
                      f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                      "heartbeat.timeout_s=4")]
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=1), 300,
                   procs.watch("trainer", "rollouter0"))
    procs.kill("rollouter0")  # its conversations are in their calculator calls, mostly
    procs.spawn("rollouter1", "rollouter", *args, "rollout.rank=1")
    assert procs.wait("trainer", 400) == 0, procs.log("trainer")
    assert procs.wait("rollouter1", 60) == 0, procs.log("rollouter1")

    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, STEPS)
    samples = {s.sample_id: s for s in await events_of(bus, run_keys.samples)
               if isinstance(s, Sample)}
    trained = [samples[sid] for e in events if isinstance(e, StepFinished)
               for sid in e.sample_ids if sid in samples]
    # What was trained after the kill came from the second replica's conversations.
    assert any(s.rank == 1 and s.tool_calls > 0 and s.num_turns > 2 for s in trained)
    # The kill left conversations of the first replica unanswered (it had claimed their
    # tickets), and the second answered them (reissued, or claimed from the dead one).
    claimed0 = {t for e in events if isinstance(e, TicketsClaimed) and e.rank == 0
                for t in e.ticket_ids}
    answered = {r: {s.ticket_id for s in samples.values() if s.rank == r} for r in (0, 1)}
    cut = claimed0 - answered[0]
    assert cut, "the kill landed between conversations: nothing to answer again"
    assert cut & answered[1], (sorted(cut), sorted(answered[1]))
