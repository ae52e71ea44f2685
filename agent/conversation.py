"""One response as a conversation (verl's tool agent loop), folded turn by turn, pure: no
engine, no tokenizer, no tools.

A conversation's response is every token after the prompt: assistant turns (generated, loss
mask 1, their sampling log-probs) and tool turns (the tools' answers rendered with the chat
template, mask 0, log-prob 0), in order. The loops drive it:

1. the engine extends the response (an assistant turn) until the turn ends (an eos id, or the
   response's token budget);
2. :func:`end_assistant_turn` records the turn (its mask, the weights version it ended on) and
   says whether the conversation may go on (:data:`AgentLimits`, verl's order of checks);
3. when it may, the turn's text is parsed for tool calls (:mod:`agent.toolcall`); none ends
   the conversation, else the tools run (:mod:`agent.toolbox`) and
   :func:`append_tool_turn` adds their rendered answers, unless they would fill the budget
   (verl then ends the conversation without them), and generation resumes from the whole
   conversation so far.

verl's counts: ``num_turns`` is user (tool) turns + assistant turns + 1 (the prompt); the
response is cut to ``response_length`` tokens at the end (:func:`final_length`).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

__all__ = ["AgentLimits", "Dialogue", "append_tool_turn", "end_assistant_turn", "final_length"]


class AgentLimits(NamedTuple):
    """verl's ``multi_turn`` bounds: ``max_assistant_turns`` / ``max_user_turns`` (None: no
    limit), ``max_parallel_calls`` per turn, and ``response_length``, the tokens of the whole
    response (assistant and tool turns together: ``rollout.max_new_tokens`` here)."""

    max_assistant_turns: int | None
    max_user_turns: int | None
    max_parallel_calls: int
    response_length: int


class Dialogue(msgspec.Struct):
    """The conversation side of one response (``rollouter.answers.Seq.dialogue``).

    ``mask``: one 0/1 per response token folded so far (tokens the engine generated in the
    turn under way are not in it yet); ``turns``: where each turn starts in the response
    (assistant first, then alternating); ``turn_versions``: the weights version each assistant
    turn ended on; ``tool_rewards``: the rewards the tools' ``execute`` returned, in order (the
    reward function gets them in ``extra_info``); ``waiting``: its tools are running (the
    engine holds nothing of it); ``over``: the conversation has ended."""

    mask: list[int] = []
    turns: list[int] = msgspec.field(default_factory=lambda: [0])
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    tool_rewards: list[float] = []
    turn_versions: list[int] = []
    waiting: bool = False
    over: bool = False

    @property
    def num_turns(self) -> int:
        """verl's ``num_turns``: user turns + assistant turns + 1."""
        return self.user_turns + self.assistant_turns + 1

    @property
    def turn_start(self) -> int:
        """Where the turn under way (or the last one) starts in the response."""
        return self.turns[-1]


def end_assistant_turn(d: Dialogue, response_len: int, version: int, limits: AgentLimits
                       ) -> bool:
    """Record the assistant turn that just ended (the response is ``response_len`` tokens
    now; the engine held weights ``version`` at its end). Whether the conversation may go on
    to a tool turn, checked in verl's order: the response's budget, then the assistant turns,
    then the user turns."""
    d.mask.extend([1] * (response_len - len(d.mask)))
    d.assistant_turns += 1
    d.turn_versions.append(version)
    if response_len >= limits.response_length:
        return False
    if limits.max_assistant_turns and d.assistant_turns >= limits.max_assistant_turns:
        return False
    return not (limits.max_user_turns and d.user_turns >= limits.max_user_turns)


def append_tool_turn(d: Dialogue, tokens: list[int], logprobs: list[float],
                     tool_tokens: list[int], *, calls: int, failures: int,
                     rewards: list[float | None], limits: AgentLimits) -> bool:
    """Add a tool turn (``tool_tokens``: the tools' answers as the chat template renders
    them, the next assistant header included) to the response ``tokens`` / ``logprobs``
    (extended in place), for ``calls`` tool calls of which ``failures`` failed. Whether
    generation goes on: not when the turn would fill the budget (verl then ends the
    conversation without it; the calls are counted all the same)."""
    d.tool_calls += calls
    d.tool_failures += failures
    d.tool_rewards.extend(float(r) for r in rewards if r is not None)
    if len(tokens) + len(tool_tokens) >= limits.response_length:
        return False
    d.turns.append(len(tokens))
    tokens.extend(tool_tokens)
    logprobs.extend([0.0] * len(tool_tokens))
    d.mask.extend([0] * len(tool_tokens))
    d.user_turns += 1
    d.turns.append(len(tokens))
    return True


def final_length(d: Dialogue, response_len: int, limits: AgentLimits) -> int:
    """How many response tokens the sample keeps: verl cuts the response, its mask and
    log-probs to ``response_length``."""
    return min(response_len, len(d.mask), limits.response_length)
