"""A rollouter's multi-turn side (verl's ``tool_agent`` loop, ``rollout.multi_turn``): which
responses are conversations, and what happens when one's assistant turn ends.

Both loops drive it the same way: the engine generates an assistant turn as it generates any
response; when the turn ends, :meth:`Conversations.after_turn` records it and, when the
conversation may go on and the turn called tools, runs the calls on the toolbox's threads
(never on the event loop or the engine's thread) and appends their answers as a tool turn;
the response is then generated further from the whole conversation so far. The built-in
engine's loop does this for a batch turn by turn; the continuous loop for each conversation
on its own, the engine generating for the others meanwhile (docs/agents.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from agent.conversation import AgentLimits, Dialogue, append_tool_turn, end_assistant_turn
from agent.render import ToolTurnRenderer
from agent.toolbox import ToolBox, load_tools
from agent.toolcall import parse_tool_calls
from policy.text import TextTokenizer
from rollouter.answers import Seq
from rollouter.engine import Off
from runconfig import Config

__all__ = ["Conversations", "limits_of"]


def limits_of(cfg: Config) -> AgentLimits:
    """The run's multi-turn bounds (verl's response_length is ``rollout.max_new_tokens``)."""
    mt = cfg.rollout.multi_turn
    return AgentLimits(mt.max_assistant_turns, mt.max_user_turns, mt.max_parallel_calls,
                       cfg.rollout.max_new_tokens)


class Conversations:
    """A replica's conversations: ``toolbox`` runs the tools, ``renderer`` makes their answers
    tokens, ``off`` runs decoding and rendering on the worker thread; the tokenizer's eos ids
    end a turn."""

    def __init__(self, cfg: Config, tokenizer: TextTokenizer, *, off: Off,
                 toolbox: ToolBox, renderer: ToolTurnRenderer) -> None:
        self.cfg, self.tokenizer, self.off = cfg, tokenizer, off
        self.limits = limits_of(cfg)
        self.format = cfg.rollout.multi_turn.format
        eos = getattr(tokenizer, "eos_ids", None) or [tokenizer.eos_id]
        self.eos_ids = frozenset(int(i) for i in eos if i is not None)
        self.toolbox, self.renderer = toolbox, renderer

    @classmethod
    def build(cls, cfg: Config, tokenizer: TextTokenizer, *, off: Off) -> Conversations | None:
        """The run's conversations (its tools loaded), or None when ``multi_turn.enable`` is
        off. Blocking: loading a tool may import a user's file."""
        mt = cfg.rollout.multi_turn
        if not mt.enable:
            return None
        hf = getattr(tokenizer, "hf", None)
        if hf is None:
            raise ValueError("rollout.multi_turn needs the model's Hugging Face tokenizer "
                             "(model.kind=hf) to render tool turns")
        box = ToolBox(load_tools(mt), timeout_s=mt.tool_timeout_s, threads=mt.tool_threads,
                      max_response_chars=mt.max_tool_response_length,
                      truncate_side=mt.tool_response_truncate_side,
                      max_parallel_calls=mt.max_parallel_calls, span=_profiled)
        renderer = ToolTurnRenderer(hf, box.schemas, cfg.data.apply_chat_template_kwargs)
        return cls(cfg, tokenizer, off=off, toolbox=box, renderer=renderer)

    def start(self, seq: Seq) -> Seq:
        """Make ``seq`` a conversation when its ticket's agent loop is ``tool_agent``."""
        if seq.ticket.agent_name == "tool_agent" and seq.dialogue is None:
            seq.dialogue = Dialogue()
        return seq

    async def after_turn(self, seq: Seq) -> bool:
        """``seq``'s assistant turn has ended (the engine says finished): record it and, when
        the conversation goes on, run its tool calls and append their answers. Whether the
        response is to be generated further (``seq.finished`` is then False again)."""
        d = seq.dialogue
        if d is None:
            return False
        d.over = not await self._next_turn(seq, d)
        seq.finished = d.over
        return not d.over

    async def _next_turn(self, seq: Seq, d: Dialogue) -> bool:
        if not end_assistant_turn(d, len(seq.tokens), seq.max_version, self.limits):
            return False
        text = await self.off(self._turn_text, seq.tokens[d.turn_start:])
        _content, calls, _malformed = parse_tool_calls(text, self.format)
        if not calls:
            return False
        d.waiting = True
        try:
            outputs = await self.toolbox.call_all(calls, _tools_kwargs(seq.ticket.extra_info))
            last = seq.tokens[-1] if seq.tokens and seq.tokens[-1] in self.eos_ids else None
            tool_tokens = await self.off(self.renderer.tokens, [o.text for o in outputs], last)
        finally:
            d.waiting = False
        return append_tool_turn(d, seq.tokens, seq.logprobs, tool_tokens,
                                calls=len(outputs), failures=sum(o.failed for o in outputs),
                                rewards=[o.reward for o in outputs], limits=self.limits)

    def _turn_text(self, ids: Sequence[int]) -> str:
        """An assistant turn's text as the tool parser reads it: up to its end token, the
        special tokens kept (verl's parser decodes them too)."""
        kept: list[int] = []
        for i in ids:
            if i in self.eos_ids:
                break
            kept.append(int(i))
        hf: Any = getattr(self.tokenizer, "hf", None)
        return str(hf.decode(kept)) if hf is not None else self.tokenizer.decode(kept)

    def metrics(self) -> dict[str, float]:
        """The pulse's tool figures, over the replica's life: ``rollouter/tool_calls``,
        ``rollouter/tool_failures`` (an error the model was told), ``rollouter/tool_timeouts``
        (past ``rollout.multi_turn.tool_timeout_s``, failures too)."""
        box = self.toolbox
        return {"rollouter/tool_calls": float(box.calls),
                "rollouter/tool_failures": float(box.failures),
                "rollouter/tool_timeouts": float(box.timeouts)}

    def close(self) -> None:
        """Stop the tool threads."""
        self.toolbox.close()


def _profiled(name: str) -> AbstractContextManager[Any]:
    """A tool call as a range of a profiled step's trace (``rlbus:tool:NAME``, on its tool
    thread: the rollouter's profiler records every thread when it has conversations). Costs
    next to nothing while no profiler runs."""
    import torch

    return torch.profiler.record_function(f"rlbus:{name}")


def _tools_kwargs(extra_info: Mapping[str, Any] | None) -> dict[str, Any]:
    """verl's per-sample tool arguments: the record's ``extra_info.tools_kwargs``."""
    kwargs = (extra_info or {}).get("tools_kwargs")
    return dict(kwargs) if isinstance(kwargs, Mapping) else {}
