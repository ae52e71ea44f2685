"""The agent demo's builder parts (tasks.agentdemo), no process: records in verl's layout,
the reward file's scores, the tool config, and the warm-up's conversations and loss mask."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.toolconfig import load_tool_config
from tasks import agentdemo

pytest.importorskip("transformers", reason="the hf extra is not installed")


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return agentdemo.build_tokenizer(tmp_path_factory.mktemp("tok"), split_digits=True)


def _score(solution: str, truth: str = "441994") -> dict[str, float]:
    scope: dict[str, Any] = {}
    exec(agentdemo.REWARD_FILE, scope)
    out: dict[str, float] = scope["compute_score"](agentdemo.DATA_SOURCE, solution, truth)
    return out


CALL = ('<tool_call>{"name": "calculator", "arguments": {"expression": "482 * 917"}}'
        "</tool_call>")
TOOL = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response>\n<|im_start|>assistant\n"


def test_records_are_verl_rows_of_tool_agent_products() -> None:
    rows = agentdemo.records(5, "train", 0)
    assert rows == agentdemo.records(5, "train", 0) != agentdemo.records(5, "test", 0)
    for i, row in enumerate(rows):
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert 100 <= a < 1000 and 100 <= b < 1000
        assert row["prompt"] == [{"role": "user", "content": f"What is {a} * {b}?"}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(a * b)}
        assert row["data_source"] == agentdemo.DATA_SOURCE == "rlbus/multiply_with_tools"
        assert row["agent_name"] == "tool_agent" and row["extra_info"]["index"] == i


def test_the_reward_needs_the_tool_and_the_exact_product() -> None:
    right = CALL + TOOL.format("441994") + "The answer is 441994."
    assert _score(right) == {"score": 1.0, "exact": 1.0, "tool_answered": 1.0}
    # The final answer counts: a right number in the call or the tool turn only does not.
    assert _score(CALL + TOOL.format("441994") + "The answer is 441995.")["score"] < 0.5
    assert _score(CALL + TOOL.format("441994") + "The answer is")["score"] == 0.0
    assert _score(CALL + TOOL.format("441994") + CALL)["score"] == 0.0
    # The right number without a tool's answer: partial credit only.
    assert _score("The answer is 441994.")["score"] == 0.5
    # Partial credit per right digit position, the number's end one more position.
    assert _score(CALL + TOOL.format("441994") + "The answer is 441000.")["score"] == \
        pytest.approx(0.5 * 4 / 7)
    assert 0.0 < _score("4 random 7")["score"] < 0.2


def test_the_tool_config_loads_the_calculator_with_the_demo_schema(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(agentdemo.TOOLS_FILE)
    (tool,) = load_tool_config(path)
    assert type(tool).__name__ == "CalculatorTool" and tool.name == "calculator"
    assert tool.tool_schema == agentdemo.SCHEMA


def test_warm_up_conversations_mask_the_assistant_tokens_only(hf: Any) -> None:
    ids, mask = agentdemo.conversation(hf, 482, 917)
    assert len(ids) == len(mask)
    text = hf.decode(ids)
    assert text.endswith(CALL + "<|im_end|>" + TOOL.format("441994").replace(
        "</tool_response>\n", "</tool_response><|im_end|>\n") + "The answer is 441994.<|im_end|>")
    assert '"name": "calculator"' in text.split("<|im_start|>user")[0]  # the tools' schema
    trained = hf.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == CALL + "<|im_end|>" + "The answer is 441994.<|im_end|>"
    # The digits are one token each: a number is copied digit by digit.
    assert [hf.decode([t]) for t in hf.encode("441994", add_special_tokens=False)] == \
        list("441994")


def test_build_demo_writes_every_file_and_skips_what_exists(tmp_path: Path) -> None:
    root = agentdemo.build_demo(tmp_path / "demo", n_train=8, n_val=4, warmup_steps=2,
                                hidden=64)
    for name in ("model/config.json", "train.parquet", "val.parquet", "reward.py",
                 "tools.yaml"):
        assert (root / name).is_file(), name
    before = (root / "model" / "model.safetensors").stat().st_mtime_ns
    agentdemo.build_demo(root, warmup_steps=2, hidden=64)
    assert (root / "model" / "model.safetensors").stat().st_mtime_ns == before
