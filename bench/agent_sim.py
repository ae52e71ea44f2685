"""The in-memory parts bench/agent_loops.py drives both rollout loops with (copied and trimmed
from tests/test_rollout_loops.py and tests/test_agent_loops.py, so the bench runs without
pytest), plus what gives the simulation its time:

- :class:`SimEngine`: a scripted engine (batch ``generate`` and streaming
  ``submit``/``advance``) whose every call sleeps on the rollouter's worker thread
  ``call_ms + steps * step_ms + tokens * token_ms`` (steps: decode steps, one token per
  running response each; tokens: the tokens it generated);
- :class:`SleepyTool`: a verl tool (create / execute / calc_reward / release, async) that
  sleeps (``asyncio.sleep``, on the toolbox's thread) the latency its call names: the
  latencies are drawn when the workload is built (seeded), written into the scripted tool
  calls' arguments, so the same workload gives both loops the same draws;
- :class:`Source` / :class:`Log`: the ticket stream and the run's log. ``Source.read``
  blocks like Redis's XREADGROUP BLOCK (up to ``block_ms`` when nothing is there; it wakes
  when a ticket is added), instead of the tests' zero wait, so an idle loop does not spin;
  it stamps every publication of samples with its time (the simulated trainer's input).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bus import Delivery, Entry, Refusal, RunKeys
from policy import EosIds, Generation
from rollouter.engine import Delta
from rollouter.scoring import Score, ScoreItem
from runschema.messages import BlobRef, Message, Sample, WeightsPublished

__all__ = ["KEYS", "Costs", "Log", "Present", "Rewards", "SimEngine", "SleepyTool", "Source",
           "weights"]

KEYS = RunKeys("agentbench")
Gate = Callable[[], bool]


def _open() -> bool:
    return True


def weights(version: int) -> WeightsPublished:
    return WeightsPublished(version=version, step=version,
                            ref=BlobRef(store="memory", key=f"w{version}", size=1, sha256="0"))


class Source:
    """The rollouters' group as one replica sees it: tickets handed out in order; what it
    was given back, publications of samples stamped (``time.monotonic``)."""

    name = RunKeys.rollouter_consumer(0)

    def __init__(self) -> None:
        self.queue: list[Delivery] = []
        self.acked: set[str] = set()
        self.dead: list[tuple[str, str]] = []
        self.published: list[tuple[float, list[Sample]]] = []
        self.added = 0
        self._arrived = asyncio.Event()

    def add(self, msg: Message) -> str:
        self.added += 1
        entry_id = f"{self.added}-0"
        self.queue.append(Delivery(entry_id, msg, 1, KEYS.prompts))
        self._arrived.set()
        return entry_id

    async def read(self, count: int = 64, block_ms: int | None = 1000) -> list[Delivery]:
        if not self.queue and block_ms:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), block_ms / 1000)
            except TimeoutError:
                pass
        await asyncio.sleep(0)
        out, self.queue = self.queue[:count], self.queue[count:]
        return out

    async def ack(self, *ids: str | Delivery) -> int:
        self.acked.update(i.id if isinstance(i, Delivery) else i for i in ids)
        return len(ids)

    async def publish_and_ack(self, stream: str, msgs: Sequence[Message],
                              *ids: str | Delivery) -> list[str]:
        await asyncio.sleep(0)
        samples = [m for m in msgs if isinstance(m, Sample)]
        if stream == KEYS.samples and samples:
            self.published.append((time.monotonic(), samples))
        self.acked.update(i.id if isinstance(i, Delivery) else i for i in ids)
        return [f"a{len(self.published)}-{i}" for i in range(len(msgs))]

    async def dead_letter(self, entry: str | Delivery, reason: str, raw: bytes = b"") -> None:
        self.dead.append((entry.id if isinstance(entry, Delivery) else entry, reason))

    async def dead_letter_many(self, refusals: Sequence[Refusal]) -> int:
        for r in refusals:
            await self.dead_letter(r.entry, r.reason, r.raw)
        return 0

    async def reclaim_from(self, owners: Iterable[str], count: int = 100) -> list[Delivery]:
        return []

    def answered(self) -> int:
        """Tickets acked or dead-lettered."""
        return len(self.acked) + len(self.dead)


class Log:
    """The run's log: entries released in order, each once its gate is open."""

    def __init__(self) -> None:
        self.script: list[tuple[Gate, Message]] = []
        self.read: list[Message] = []
        self.caught_up = True
        self.position = "0"

    def add(self, *msgs: Message, when: Gate = _open) -> None:
        self.script += [(when, m) for m in msgs]

    async def poll(self, block_ms: int | None = None) -> list[Entry]:
        await asyncio.sleep(0)
        out: list[Entry] = []
        while self.script and self.script[0][0]():
            msg = self.script.pop(0)[1]
            self.read.append(msg)
            self.position = f"{len(self.read)}-0"
            out.append(Entry(self.position, msg))
        return out


class Present:
    """A trainer that is always there."""

    async def check(self) -> None:
        pass


@dataclass
class Rewards:
    """Reward 0 for everything (the bench measures time, not learning)."""

    failures: int = 0
    timeouts: int = 0

    async def score(self, items: list[ScoreItem]) -> list[Score]:
        return [Score(0.0, {}, 0.0, False) for _ in items]

    def take_warning(self) -> str | None:
        return None

    def fails_ticket(self, data_source: str) -> bool:
        return False

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Costs:
    """An engine call's simulated time: ``call_ms`` + ``step_ms`` per decode step +
    ``token_ms`` per token generated."""

    call_ms: float = 2.0
    step_ms: float = 20.0
    token_ms: float = 0.25

    def seconds(self, steps: int, tokens: int) -> float:
        return (self.call_ms + steps * self.step_ms + tokens * self.token_ms) / 1000


@dataclass
class SimEngine:
    """Assistant turn ``k`` of conversation ``c`` (``k``: the tool answers in its context so
    far, counted by the ``<tool_response>`` token) is ``script[c's prompt ids][k]``; the
    conversation is found by its prompt's ids. Log-prob -0.5 per token.

    Batch (``generate``, a static batch: a call runs as many steps as its longest turn) and
    streaming (``submit``/``advance``: every running response one token per step; a slice
    stops after the step in which a response ends). Every call sleeps its :class:`Costs` on
    the calling (worker) thread; ``busy`` holds each call's (start, end)."""

    eos_id: int
    tool_response_id: int
    script: dict[tuple[int, ...], list[list[int]]]
    costs: Costs
    name: str = "sim"
    version: int = -1
    steps: int = 0
    tokens: int = 0
    calls: int = 0
    busy: list[tuple[float, float]] = field(default_factory=list)
    streamed: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_lengths = sorted({len(p) for p in self.script})

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def _turn(self, context: Sequence[int]) -> list[int]:
        for n in self.prompt_lengths:
            turns = self.script.get(tuple(context[:n]))
            if turns is not None:
                k = list(context[n:]).count(self.tool_response_id)
                return turns[min(k, len(turns) - 1)]
        raise ValueError("a context of no scripted conversation")

    def _spend(self, began: float, steps: int, tokens: int) -> None:
        """Sleep what the call costs (less what it took already), and count it."""
        left = self.costs.seconds(steps, tokens) - (time.monotonic() - began)
        if left > 0:
            time.sleep(left)
        self.steps += steps
        self.tokens += tokens
        self.calls += 1
        self.busy.append((began, time.monotonic()))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 1.0, eos_id: EosIds = None, *,
                 generator: torch.Generator | None = None, top_p: float = 1.0,
                 top_k: int = -1) -> Generation:
        began = time.monotonic()
        out = [self._turn(p)[:max_new_tokens] for p in prompts]
        self._spend(began, max((len(t) for t in out), default=0), sum(len(t) for t in out))
        return Generation(out, [np.full(len(t), -0.5, np.float32) for t in out],
                          [bool(t) and t[-1] == self.eos_id for t in out])

    @property
    def in_flight(self) -> int:
        return len(self.streamed)

    def submit(self, key: str, prompt: Sequence[int], max_new_tokens: int,
               temperature: float, eos_id: EosIds, *, generator: torch.Generator | None,
               top_p: float, top_k: int) -> None:
        self.streamed[key] = list(self._turn(prompt)[:max_new_tokens])

    def advance(self, max_steps: int) -> list[Delta]:
        began = time.monotonic()
        if not self.streamed:
            return []
        k = min(max_steps, min(len(t) for t in self.streamed.values()))
        out: list[Delta] = []
        for key, left in list(self.streamed.items()):
            head, rest = left[:k], left[k:]
            out.append(Delta(key, head, [-0.5] * len(head), not rest))
            if rest:
                self.streamed[key] = rest
            else:
                del self.streamed[key]
        self._spend(began, k, sum(len(d.tokens) for d in out))
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


class SleepyTool:
    """verl's tool interface; ``wait(ms)`` answers "ok" after ``ms`` milliseconds (an
    ``asyncio.sleep`` on the toolbox thread's loop: calls overlap freely)."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any] | None) -> None:
        self.name = "wait"
        self.tool_schema = tool_schema or {"type": "function", "function": {
            "name": "wait", "description": "waits ms milliseconds", "parameters": {
                "type": "object", "properties": {"ms": {"type": "integer"}},
                "required": ["ms"]}}}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any:
        return "i", None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> Any:
        await asyncio.sleep(float(parameters.get("ms", 0)) / 1000)
        return "ok", 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        pass
