"""Conversations with tools (rollout.multi_turn) in both rollout loops, driven as
tests/test_rollout_loops.py drives them (parts in memory, no Redis, no processes), with a
real Hugging Face tokenizer and chat template (tasks.agentdemo), the built-in calculator
tool loaded from a verl tool config, and a scripted engine whose every assistant turn is
the next line of a script: a conversation's tokens, mask and versions are checked token by
token against what the chat template writes."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from policy import EosIds, Generation
from rollouter.batch import BatchRollout
from rollouter.context import RolloutContext, RolloutLoop
from rollouter.continuous import ContinuousRollout
from rollouter.conversations import Conversations
from rollouter.engine import Delta
from rollouter.scoring import Score, ScoreItem
from runconfig import Config, load_config
from runschema.messages import Event, PromptTicket, Sample
from tasks.agentdemo import build_model
from tests.test_rollout_loops import (
    BOUND_S,
    KEYS,
    Present,
    ScriptedLog,
    ScriptedSource,
    _weights,
)

CALL = '<tool_call>{{"name": "{tool}", "arguments": {{"expression": "{expr}"}}}}</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("agent") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from policy.text import HFTokenizer

    return HFTokenizer(model_dir)


class GatedTool:
    """A tool (verl's interface) that answers only once its ``gate`` is set: a conversation
    held in its tool call while the test watches the others. (Loaded by its dotted name,
    this module may be a second copy of the test's: the test reaches the instance the
    toolbox holds, :func:`_gate`.)"""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any] | None) -> None:
        self.name = "slow"
        self.gate = threading.Event()
        self.tool_schema = tool_schema or {"type": "function", "function": {
            "name": "slow", "description": "waits", "parameters": {"type": "object",
                                                                    "properties": {}}}}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any:
        return "i", None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> Any:
        await asyncio.to_thread(self.gate.wait, BOUND_S)
        return "late", 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        pass


def _gate(h: Harness) -> threading.Event:
    """The gate of the GatedTool the harness's toolbox holds."""
    assert h.ctx.conversations is not None
    gate: threading.Event = h.ctx.conversations.toolbox._tools["slow"].gate
    return gate


@dataclass
class Rewards:
    """Records what the reward function is given; reward 1 when the text names the truth."""

    items: list[ScoreItem] = field(default_factory=list)
    failures: int = 0
    timeouts: int = 0

    async def score(self, items: list[ScoreItem]) -> list[Score]:
        self.items += items
        return [Score(float(str(i.ground_truth) in i.solution_str), {}, 0.0, False)
                for i in items]

    def take_warning(self) -> str | None:
        return None

    def fails_ticket(self, data_source: str) -> bool:
        return False

    def close(self) -> None:
        pass


@dataclass
class ScriptedEngine:
    """Assistant turn ``k`` of a conversation (``k`` = tool answers in its context so far)
    is ``script[prompt][k]`` followed by the turn's end, cut to the tokens asked for;
    log-prob -0.5 each. Batch (generate) and streaming (submit/advance) alike."""

    tok: Any
    script: dict[str, list[str]]
    name: str = "scripted"
    version: int = -1
    steps: int = 0
    streamed: dict[str, list[int]] = field(default_factory=dict)
    submitted: list[tuple[str, int]] = field(default_factory=list)  # key, version

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.tok.eos_id,)

    def _turn(self, context: Sequence[int]) -> list[int]:
        text = self.tok.hf.decode(list(context))
        question = next(q for q in self.script if q in text)
        k = text.count("<tool_response>")
        lines = self.script[question]
        return [*self.tok.hf.encode(lines[min(k, len(lines) - 1)], add_special_tokens=False),
                self.tok.eos_id]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 1.0, eos_id: EosIds = None, *,
                 generator: torch.Generator | None = None, top_p: float = 1.0,
                 top_k: int = -1) -> Generation:
        out = [self._turn(p)[:max_new_tokens] for p in prompts]
        self.steps += 1
        return Generation(out, [np.full(len(t), -0.5, np.float32) for t in out],
                          [bool(t) and t[-1] == self.tok.eos_id for t in out])

    @property
    def in_flight(self) -> int:
        return len(self.streamed)

    def submit(self, key: str, prompt: Sequence[int], max_new_tokens: int,
               temperature: float, eos_id: EosIds, *, generator: torch.Generator | None,
               top_p: float, top_k: int) -> None:
        self.streamed[key] = self._turn(prompt)[:max_new_tokens]
        self.submitted.append((key, self.version))

    def advance(self, max_steps: int) -> list[Delta]:
        self.steps += 1
        out = [Delta(k, t, [-0.5] * len(t), True) for k, t in self.streamed.items()]
        self.streamed.clear()
        return out

    def abort(self) -> list[Delta]:
        self.streamed.clear()
        return []

    def cancel(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.streamed.pop(k, None)

    def load_state(self, state: Any, version: int) -> None:
        self.version = version

    def close(self) -> None:
        pass


async def _off(fn: Any, *args: Any, **kwargs: Any) -> Any:
    await asyncio.sleep(0)
    return fn(*args, **kwargs)


@dataclass
class Harness:
    cfg: Config
    source: ScriptedSource
    log: ScriptedLog
    engine: ScriptedEngine
    ctx: RolloutContext
    rewards: Rewards

    def loop(self, kind: str) -> RolloutLoop:
        if kind == "continuous":
            return ContinuousRollout(self.ctx, self.engine)
        return BatchRollout(self.ctx, self.engine)

    async def run(self, kind: str) -> None:
        await asyncio.wait_for(self.ctx.weights.first(), BOUND_S)
        try:
            await asyncio.wait_for(self.loop(kind).run(), BOUND_S)
            await self.ctx.tickets.delivered()
        finally:
            await self.ctx.stop()
            assert self.ctx.conversations is not None
            self.ctx.conversations.close()

    def end_when(self, gate: Any) -> None:
        from runschema.messages import RunFinished, StepFinished

        self.log.add(StepFinished(step=1, sample_ids=[], metrics={}, duration_s=0.0),
                     RunFinished(run_id="loops", steps=1), when=gate)


TOOLS = ("tools:\n"
         "  - class_name: agent.calculator.CalculatorTool\n    config: {}\n"
         "  - class_name: tests.test_agent_loops.GatedTool\n    config: {}\n")


def _harness(tmp_path: Path, model_dir: Path, tokenizer: Any, script: dict[str, list[str]],
             *overrides: str, tools_yaml: str = TOOLS) -> Harness:
    tools = tmp_path / "tools.yaml"
    tools.write_text(tools_yaml)
    cfg = load_config(None, [
        "trainer.total_training_steps=1", "rollout.prompts_per_batch=4",
        "rollout.max_new_tokens=200", "rollout.weights_fetch_timeout_s=5", "model.kind=hf",
        f"model.path={model_dir}", "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config_path={tools}", *overrides])
    engine = ScriptedEngine(tokenizer, script)
    source, log = ScriptedSource(), ScriptedLog()
    events: list[Event] = []
    rewards = Rewards()

    async def publish(*msgs: Event) -> None:
        events.extend(msgs)

    async def fetch(msg: Any) -> Any:
        return {"w": torch.full((1,), float(msg.version))}

    async def load(state: Any, version: int) -> None:
        await _off(engine.load_state, state, version)

    async def nobody() -> list[str]:
        return []

    async def nothing() -> None:
        pass

    ctx = RolloutContext(
        cfg, rank=0, keys=KEYS, tokenizer=tokenizer, generator=torch.Generator(), off=_off,
        source=source, log=log, trainer=Present(), fetch=fetch, load=load,
        stranded=lambda msg: False, find_dead=nobody, publish=publish,
        complain=lambda text: None, commands=nothing, profiler=lambda: None, rewards=rewards)
    ctx.conversations = Conversations.build(cfg, tokenizer, off=_off)
    log.add(_weights(0))
    return Harness(cfg, source, log, engine, ctx, rewards)


def _ticket(tid: str, question: str, tokenizer: Any, truth: str, n: int = 1) -> PromptTicket:
    text = tokenizer.hf.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=False)
    return PromptTicket(ticket_id=tid, prompt_id=tid, prompt=text, answer=truth, n=n,
                        min_version=0, prompt_ids=tokenizer.hf.encode(text,
                                                                     add_special_tokens=False),
                        agent_name="tool_agent", extra_info={"index": 7})


LOOPS = ["batch", "continuous"]
TOOL_TURN = ("\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n")


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", LOOPS)
async def test_a_three_turn_conversation_is_one_sample_its_mask_exact(
        kind: str, tmp_path: Path, model_dir: Path, tokenizer: Any) -> None:
    turns = [CALL.format(tool="calculator", expr="2+3"),
             CALL.format(tool="calculator", expr="5*7"), "The answer is 35."]
    h = _harness(tmp_path, model_dir, tokenizer, {"What is (2+3)*7?": turns})
    entry = h.source.add(_ticket("a", "What is (2+3)*7?", tokenizer, "35"))
    h.end_when(lambda: h.source.answered(entry))
    await h.run(kind)

    (sample,) = h.source.samples()["a"]
    enc = tokenizer.hf.encode
    eos = tokenizer.eos_id
    parts = [([*enc(turns[0], add_special_tokens=False), eos], 1),
             (enc(TOOL_TURN.format("5"), add_special_tokens=False), 0),
             ([*enc(turns[1], add_special_tokens=False), eos], 1),
             (enc(TOOL_TURN.format("35"), add_special_tokens=False), 0),
             ([*enc(turns[2], add_special_tokens=False), eos], 1)]
    tokens = [t for ids, _ in parts for t in ids]
    mask = [m for ids, m in parts for _ in ids]
    assert sample.response_tokens.numpy().tolist() == tokens
    assert sample.response_mask is not None
    assert sample.response_mask.numpy().tolist() == mask
    assert sample.logprobs.numpy().tolist() == [-0.5 if m else 0.0 for m in mask]
    assert (sample.num_turns, sample.tool_calls, sample.tool_failures) == (6, 2, 0)
    assert sample.turn_versions == [0, 0, 0]
    assert (sample.min_version, sample.max_version, sample.finish_reason) == (0, 0, "eos")
    assert sample.reward == 1.0
    # The reward function reads the whole conversation and verl's extra_info additions.
    (item,) = h.rewards.items
    assert item.solution_str == tokenizer.hf.decode(tokens, skip_special_tokens=True)
    assert h.ctx.conversations is not None  # the pulse's figures
    assert h.ctx.conversations.metrics() == {"rollouter/tool_calls": 2.0,
                                             "rollouter/tool_failures": 0.0,
                                             "rollouter/tool_timeouts": 0.0}
    assert "<tool_response>\n35\n</tool_response>" in item.solution_str
    assert item.extra_info == {"index": 7, "num_turns": 6, "tool_rewards": [0.0, 0.0],
                               "turn_scores": []}


def test_a_steps_conversations_give_verls_turn_and_tool_call_figures() -> None:
    from runschema.messages import Array
    from trainer.metrics import conversation_metrics

    def sample(turns: int, calls: int, failures: int) -> Any:
        ids = Array.of(np.zeros(3, np.int32))
        return Sample(sample_id="s", ticket_id="t", prompt_id="p", index=0, n=1,
                      prompt_tokens=ids, response_tokens=ids,
                      logprobs=Array.of(np.zeros(3, np.float32)), reward=0.0, min_version=0,
                      max_version=0, num_turns=turns, tool_calls=calls, tool_failures=failures)

    assert conversation_metrics([sample(0, 0, 0)]) == {}
    got = conversation_metrics([sample(6, 2, 1), sample(0, 0, 0), sample(4, 2, 0)])
    assert got == {"num_turns/mean": 4.0, "num_turns/max": 6.0, "num_turns/min": 2.0,
                   "tool_call_counts/mean": 4 / 3, "tool_call_counts/max": 2.0,
                   "tool_call_counts/min": 0.0, "tool_calls/failure_ratio": 0.25}


async def _after(gate: Any, then: Any) -> None:
    """``then()`` once ``gate()`` holds (polled on the loop, bounded)."""
    for _ in range(int(BOUND_S / 0.005)):
        if gate():
            then()
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the gate never opened")


@pytest.mark.asyncio
async def test_a_conversation_in_its_tool_call_holds_back_no_other(
        tmp_path: Path, model_dir: Path, tokenizer: Any) -> None:
    h = _harness(tmp_path, model_dir, tokenizer, {
        "Wait for it": ['<tool_call>{"name": "slow", "arguments": {}}</tool_call>', "Done 1."],
        "What is 6*7?": [CALL.format(tool="calculator", expr="6*7"), "It is 42."]})
    slow = h.source.add(_ticket("slow", "Wait for it", tokenizer, "1"))
    fast = h.source.add(_ticket("fast", "What is 6*7?", tokenizer, "42"))
    h.end_when(lambda: h.source.answered(slow, fast))
    seen: list[bool] = []
    release = asyncio.create_task(_after(lambda: h.source.answered(fast),
                                         lambda: (seen.append(h.source.answered(slow)),
                                                  _gate(h).set())))
    await h.run("continuous")
    await release
    # The fast conversation made both its turns and went out while the slow one was still
    # in its tool call; then the slow one ended too.
    assert seen == [False]
    by = h.source.samples()
    assert by["fast"][0].reward == 1.0 and by["fast"][0].num_turns == 4
    assert by["slow"][0].num_turns == 4 and by["slow"][0].tool_failures == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "partial"), [("batch", False), ("continuous", False),
                                               ("continuous", True)])
async def test_weights_that_come_during_a_tool_call_generate_the_next_turn(
        kind: str, partial: bool, tmp_path: Path, model_dir: Path, tokenizer: Any) -> None:
    h = _harness(tmp_path, model_dir, tokenizer, {
        "Wait for it": ['<tool_call>{"name": "slow", "arguments": {}}</tool_call>', "Done."]},
        f"async_training.partial_rollout={str(partial).lower()}")
    entry = h.source.add(_ticket("a", "Wait for it", tokenizer, "Done"))
    h.log.add(_weights(1), when=lambda: h.engine.steps >= 1)
    h.end_when(lambda: h.source.answered(entry))
    release = asyncio.create_task(_after(
        lambda: h.ctx.weights.ready() or h.ctx.weights.version == 1, _gate(h).set))
    await h.run(kind)
    await release
    (sample,) = h.source.samples()["a"]
    # docs/agents.md: a sync waits for the turn under way, not for the conversation.
    assert sample.turn_versions == [0, 1]
    assert (sample.min_version, sample.max_version) == (0, 1)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", LOOPS)
async def test_turn_limits_budget_and_failed_calls_end_conversations_as_verl(
        kind: str, tmp_path: Path, model_dir: Path, tokenizer: Any) -> None:
    loop_forever = [CALL.format(tool="calculator", expr="1+1")]
    h = _harness(tmp_path, model_dir, tokenizer, {
        "Loop": loop_forever,
        "Bad": ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "Sorry."],
        "Broken": ['<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}'
                   "</tool_call>", "Sorry."]},
        "rollout.multi_turn.max_assistant_turns=3")
    entries = [h.source.add(_ticket(t, t, tokenizer, "x")) for t in ("Loop", "Bad", "Broken")]
    h.end_when(lambda: h.source.answered(*entries))
    await h.run(kind)
    by = {tid: s for tid, (s,) in h.source.samples().items()}
    # max_assistant_turns=3: the third turn's call is not run.
    assert (by["Loop"].num_turns, by["Loop"].tool_calls) == (6, 2)
    assert sum(by["Loop"].response_mask.numpy()) == 3 * (len(tokenizer.hf.encode(
        loop_forever[0], add_special_tokens=False)) + 1)
    # An unknown tool is told to the model, counted as a failure; the conversation goes on.
    assert (by["Bad"].num_turns, by["Bad"].tool_calls, by["Bad"].tool_failures) == (4, 1, 1)
    text = tokenizer.hf.decode(by["Bad"].response_tokens.numpy().tolist())
    assert "Unknown function 'nope'" in text
    assert by["Broken"].tool_calls == 1


@pytest.mark.asyncio
async def test_a_tool_turn_that_would_fill_the_budget_ends_the_conversation(
        tmp_path: Path, model_dir: Path, tokenizer: Any) -> None:
    call = CALL.format(tool="calculator", expr="2+2")
    used = len(tokenizer.hf.encode(call, add_special_tokens=False)) + 1
    h = _harness(tmp_path, model_dir, tokenizer, {"Q": [call, "Four."]},
                 f"rollout.max_new_tokens={used + 5}")
    entry = h.source.add(_ticket("a", "Q", tokenizer, "4"))
    h.end_when(lambda: h.source.answered(entry))
    await h.run("batch")
    (sample,) = h.source.samples()["a"]
    # verl: the tool turn is not appended when the response would reach response_length.
    assert len(sample.response_tokens) == used
    assert (sample.num_turns, sample.tool_calls) == (2, 1)
    assert sample.response_mask.numpy().tolist() == [1] * used


@pytest.mark.asyncio
async def test_a_tool_agent_record_is_validated_as_a_conversation(
        tmp_path: Path, model_dir: Path, tokenizer: Any) -> None:
    from rollouter.validation import Validator
    from runschema.messages import ValidationRequested
    from tasks.verl_data import VerlRecord

    turns = [CALL.format(tool="calculator", expr="6*7"), "It is 42."]
    h = _harness(tmp_path, model_dir, tokenizer, {"What is 6*7?": turns, "Say 42": ["42"]},
                 "rollout.val_kwargs.n=2")

    def record(i: int, question: str, agent: str) -> VerlRecord:
        t = _ticket(f"v{i}", question, tokenizer, "42")
        return VerlRecord(i, list(t.prompt_ids or []), t.prompt, f"src{i}", "42", {"i": i},
                          agent)

    assert h.ctx.conversations is not None
    validator = Validator([record(0, "What is 6*7?", "tool_agent"),
                           record(1, "Say 42", "single_turn_agent")], h.rewards.score, h.cfg,
                          tokenizer, conversations=h.ctx.conversations)
    try:
        done = await validator.run(ValidationRequested(request_id="val-v0", version=0, step=0),
                                   policy=h.engine, off=_off, version=0, rank=0)
    finally:
        h.ctx.conversations.close()
    assert done.metrics["val-core/src0/reward/mean@2"] == 1.0
    assert done.metrics["val-core/src1/reward/mean@2"] == 1.0
    conv = [i for i in h.rewards.items if i.data_source == "src0"]
    assert len(conv) == 2 and all(i.extra_info and i.extra_info["num_turns"] == 4
                                  for i in conv)
    assert all("<tool_response>\n42\n</tool_response>" in i.solution_str for i in conv)
    assert [i.extra_info for i in h.rewards.items if i.data_source == "src1"] == [{"i": 1}] * 2


@pytest.mark.asyncio
async def test_code_that_runs_forever_or_eats_memory_is_killed_and_the_conversation_goes_on(
        tmp_path: Path, model_dir: Path, tokenizer: Any) -> None:
    def code(src: str) -> str:
        call = {"name": "code_interpreter", "arguments": {"code": src}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"

    h = _harness(tmp_path, model_dir, tokenizer, {
        "Spin": [code("while True: pass"), "Gave up."],
        "Eat": [code("x = bytearray(10 * 1024**3)"), "Gave up."],
        "Add": [code("print(40 + 2)"), "42"]},
        "rollout.multi_turn.max_tool_response_length=2000", "rollout.max_new_tokens=2000",
        tools_yaml="tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n"
                   "    config: {default_timeout: 2, memory_limit_mb: 256, num_workers: 3}\n")
    entries = [h.source.add(_ticket(t, t, tokenizer, "42")) for t in ("Spin", "Eat", "Add")]
    h.end_when(lambda: h.source.answered(*entries))
    await h.run("continuous")
    by = {tid: s for tid, (s,) in h.source.samples().items()}
    text = {tid: tokenizer.hf.decode(s.response_tokens.numpy().tolist())
            for tid, s in by.items()}
    assert "timed out" in text["Spin"] and text["Spin"].endswith("Gave up.<|im_end|>")
    assert "memory" in text["Eat"] and text["Eat"].endswith("Gave up.<|im_end|>")
    assert "<tool_response>\n42\n\n</tool_response>" in text["Add"]  # print's newline kept
    assert by["Add"].reward == 1.0
    assert all(s.num_turns == 4 and s.tool_calls == 1 for s in by.values())


def test_a_replica_whose_conversations_wait_on_a_slow_tool_is_slow_not_dead(
        model_dir: Path) -> None:
    """The trainer takes tickets from a live rollouter only after it made no progress for
    longer than one tool call may take (a tool call ended moves its progress counter)."""
    from tasks import build_prompt_source
    from trainer.dispatch import Dispatch

    def bound(*overrides: str) -> float:
        cfg = load_config(None, ["heartbeat.timeout_s=30", "rollout.reward_timeout_s=30",
                                 *overrides])
        return Dispatch(cfg, build_prompt_source(cfg), dlq="dlq").progress_bound()

    assert bound() == 30.0
    assert bound("rollout.multi_turn.tool_timeout_s=300") == 30.0  # no conversations
    assert bound("model.kind=hf", f"model.path={model_dir}", "rollout.multi_turn.enable=true",
                 "rollout.multi_turn.function_tool_path=tools.py",
                 "rollout.multi_turn.tool_timeout_s=300") == 300.0


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", LOOPS)
async def test_a_tool_turn_that_cannot_be_made_fails_its_ticket_which_is_retried(
        kind: str, tmp_path: Path, model_dir: Path, tokenizer: Any) -> None:
    turns = [CALL.format(tool="calculator", expr="2+3"), "5."]
    h = _harness(tmp_path, model_dir, tokenizer, {"Q": turns})
    talks = h.ctx.conversations
    assert talks is not None
    render, calls = talks.renderer.tokens, []

    def broken_once(answers: Any, last: Any) -> list[int]:
        calls.append(answers)
        if len(calls) == 1:
            raise ValueError("the template failed")
        return render(answers, last)

    talks.renderer.tokens = broken_once  # type: ignore[method-assign]
    entry = h.source.add(_ticket("a", "Q", tokenizer, "5"))
    h.end_when(lambda: h.source.answered(entry))
    await h.run(kind)
    (sample,) = h.source.samples()["a"]
    assert len(calls) == 2 and sample.num_turns == 4 and sample.reward == 1.0
