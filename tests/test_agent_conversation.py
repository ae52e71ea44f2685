"""A conversation folded turn by turn (agent.conversation): pure, property-tested."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.conversation import (
    AgentLimits,
    Dialogue,
    append_tool_turn,
    end_assistant_turn,
    final_length,
)

turns = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=8)
limits = st.builds(AgentLimits, st.none() | st.integers(1, 6), st.none() | st.integers(1, 6),
                   st.just(1), st.integers(5, 200))


def _converse(plan: list[tuple[int, int]], lim: AgentLimits
              ) -> tuple[Dialogue, list[int], list[float], list[int]]:
    """Drive a conversation: assistant turn i generates plan[i][0] tokens (cut to the
    budget, as the engine is asked), then a tool turn of plan[i][1] tokens when it may."""
    d, tokens, logprobs, kinds = Dialogue(), [], [], []
    for i, (said, answered) in enumerate(plan):
        n = min(said, lim.response_length - len(tokens))
        tokens += [1000 + i] * n
        logprobs += [-0.5] * n
        kinds += [1] * n
        if not end_assistant_turn(d, len(tokens), version=i, limits=lim):
            break
        if i == len(plan) - 1:
            break  # the last turn called no tool
        tool = [2000 + i] * answered
        if not append_tool_turn(d, tokens, logprobs, tool, calls=1, failures=0,
                                rewards=[None], limits=lim):
            break
        kinds += [0] * answered
    return d, tokens, logprobs, kinds


@given(turns, limits)
def test_the_mask_marks_exactly_the_generated_tokens_and_stays_in_budget(
        plan: list[tuple[int, int]], lim: AgentLimits) -> None:
    d, tokens, logprobs, kinds = _converse(plan, lim)
    assert d.mask == kinds and len(d.mask) == len(tokens) == len(logprobs)
    assert all((lp == 0.0) == (m == 0) for lp, m in zip(logprobs, d.mask, strict=True))
    assert len(tokens) <= lim.response_length
    assert final_length(d, len(tokens), lim) == len(tokens)
    # verl's counts: every turn after the prompt, and the prompt.
    assert d.num_turns == d.assistant_turns + d.user_turns + 1
    assert d.tool_calls >= d.user_turns
    assert d.turn_versions == list(range(d.assistant_turns))
    assert d.turns == sorted(d.turns) and d.turns[0] == 0


@given(turns, limits)
def test_the_turn_limits_hold_in_verls_order(plan: list[tuple[int, int]],
                                             lim: AgentLimits) -> None:
    d, _, _, _ = _converse(plan, lim)
    if lim.max_assistant_turns is not None:
        assert d.assistant_turns <= lim.max_assistant_turns
    if lim.max_user_turns is not None:
        assert d.user_turns <= lim.max_user_turns
    assert d.user_turns <= d.assistant_turns


def test_a_tool_turn_that_would_reach_the_budget_is_not_appended_but_counted() -> None:
    lim = AgentLimits(None, None, 1, 10)
    d, tokens, logprobs = Dialogue(), [7] * 6, [-1.0] * 6
    assert end_assistant_turn(d, 6, version=3, limits=lim)
    assert not append_tool_turn(d, tokens, logprobs, [9] * 4, calls=2, failures=1,
                                rewards=[0.5, None], limits=lim)
    assert (tokens, d.mask, d.user_turns) == ([7] * 6, [1] * 6, 0)
    assert (d.tool_calls, d.tool_failures, d.tool_rewards) == (2, 1, [0.5])
