"""The agent demo's config (configs/agent_demo.yaml, verl's keys, rollout.multi_turn) run end
to end, shortened: ``rlbus up`` on the files ``tasks.agentdemo`` builds (a smaller model, a
shorter warm-up), embedded Redis, rollouter, trainer as processes. The run must finish, and
what it trained must be conversations: a calculator call, the tool's answer in the response
as context (mask 0), then the assistant's answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollouter.engine import vllm_installed
from runschema.messages import Sample, decode
from tests.procs import run_cli

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
STEPS = 4


ENGINES = ["hf", pytest.param("vllm", marks=[
    pytest.mark.vllm, pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed "
                                                                       "(make vllm)")])]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_agent_demo_config_trains_on_conversations_with_the_calculator(
        tmp_path: Path, engine: str) -> None:
    """On the built-in engine (a batch turn by turn) and on vLLM (continuous admission: a
    conversation leaves the engine for its tool call and rejoins it)."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    import msgspec
    import pyarrow.parquet as pq

    from tasks.agentdemo import build_demo

    # A warm-up long enough that the model writes calculator calls, short enough for a test.
    files = build_demo(tmp_path / "agentdemo", n_train=64, n_val=8, hidden=64,
                       warmup_steps=120)
    out = tmp_path / "out"
    done = run_cli(
        "up", "--config", str(ROOT / "configs" / "agent_demo.yaml"),
        f"data.train_files={files / 'train.parquet'}", f"data.val_files={files / 'val.parquet'}",
        f"custom_reward_function.path={files / 'reward.py'}",
        f"actor_rollout_ref.model.path={files / 'model'}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={files / 'tools.yaml'}",
        f"trainer.total_training_steps={STEPS}", "trainer.logger=[console]",
        "trainer.test_freq=2", "trainer.val_before_train=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "async_training.require_batches=2",
        f"run.output_dir={out}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"actor_rollout_ref.rollout.name={engine}", "actor_rollout_ref.rollout.enforce_eager=true",
        cwd=tmp_path, timeout_s=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = [p.parent for p in out.glob("*/config.yaml")]
    shown = run_cli("inspect", "--run", run_dir.name, "--json", f"run.output_dir={out}",
                    cwd=tmp_path, timeout_s=120)
    assert shown.returncode == 0, shown.stderr
    events = [json.loads(line) for line in shown.stdout.splitlines()]
    steps = [e for e in events if e.get("type") == "StepFinished"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    for e in steps:
        assert "critic/score/mean" in e["metrics"]
        assert "reward_extra/tool_answered/mean" in e["metrics"]  # the reward file's extras
        assert e["metrics"]["num_turns/max"] >= 4 and "tool_call_counts/mean" in e["metrics"]
    # Validation runs the conversations too (before training, and every test_freq versions).
    vals = [e for e in events if e.get("type") == "ValidationFinished"]
    assert sorted(e["version"] for e in vals) == [0, 2, 4], vals
    assert all("val-core/rlbus/multiply_with_tools/reward_extra/tool_answered/mean@1"
               in e["metrics"] or any("tool_answered" in k for k in e["metrics"])
               for e in vals)
    assert max(v for e in vals for k, v in e["metrics"].items() if "tool_answered" in k) > 0
    # The trained samples, from the run's record: conversations with calculator calls.
    rows = [row for f in sorted((run_dir / "record").glob("samples-*.parquet"))
            for row in pq.read_table(f).to_pylist() if row["verdict"] == "trained"]
    trained = [msgspec.msgpack.decode(row["raw"]) for row in rows]
    assert trained
    # The record's text of a conversation is all of it, the tool's answer included.
    assert any("<tool_call>" in r["response"] and "<tool_response>" in r["response"]
               for r in rows)
    talks = [s for s in trained if s["num_turns"] > 2 and s["tool_calls"] > 0]
    assert talks, [(s["num_turns"], s["tool_calls"]) for s in trained]
    assert all(s["tool_failures"] == 0 for s in talks)  # the calculator answered each call
    assert any(s["num_turns"] == 4 and len(s["turn_versions"]) == 2 for s in talks)
    # Token by token: a two-turn conversation's mask is 1 on its call (and its end token),
    # 0 on exactly the tool turn the chat template writes for the calculator's answer, 1 on
    # the answer.
    checked = sum(_mask_is_exact(decode(row["raw"]), files / "model") for row in rows)
    assert checked > 0


def _mask_is_exact(sample: Any, model_dir: Path) -> bool:
    """Whether ``sample`` is a two-turn conversation (False if not), asserting its mask."""
    from agent.calculator import evaluate, render
    from agent.render import ToolTurnRenderer
    from agent.toolcall import parse_tool_calls
    from policy.text import HFTokenizer
    from tasks.agentdemo import SCHEMA

    if not (isinstance(sample, Sample) and sample.num_turns == 4 and sample.tool_failures == 0):
        return False
    tok = HFTokenizer(model_dir)
    tokens = sample.response_tokens.numpy().tolist()
    end = tokens.index(tok.eos_id) + 1  # the call's turn, its end token included
    _, (call,), _ = parse_tool_calls(tok.hf.decode(tokens[:end - 1]))
    answer = render(evaluate(json.loads(call.arguments)["expression"]))
    tool = ToolTurnRenderer(tok.hf, [SCHEMA]).tokens([answer], tok.eos_id)
    assert tokens[end:end + len(tool)] == tool
    mask = sample.response_mask.numpy().tolist()
    assert mask == [1] * end + [0] * len(tool) + [1] * (len(tokens) - end - len(tool))
    return True
