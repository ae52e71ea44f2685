"""The rollouter's two rollout loops (rollouter.batch, rollouter.continuous) driven through
their context (rollouter.context) with parts in memory: no Redis, no processes.

The context is wired as the rollouter wires it, from sources of the test's: a scripted
ticket source (the tickets, and the acks, answers and dead letters it is given), a scripted
log (entries released in order, each once its condition holds), a recorded publisher, an
in-memory reward and a tiny deterministic engine (a batch one for the batch loop, a
streaming one for the continuous loop). Every wait is on the loop's own progress, bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest
import torch

from bus import Delivery, Entry, Refusal, RunKeys
from policy import EosIds, Generation
from policy.tokenizer import CharTokenizer
from rollouter.batch import BatchRollout
from rollouter.context import RolloutContext, RolloutLoop
from rollouter.continuous import ContinuousRollout
from rollouter.engine import Delta
from rollouter.scoring import Score, ScoreItem
from rollouter.tickets import MAX_ATTEMPTS
from rollouter.validation import Validator
from rollouter.weights import State
from runconfig import Config, load_config
from runschema.messages import (
    Array,
    BlobRef,
    Event,
    Message,
    PromptTicket,
    RolloutFailed,
    RunFinished,
    Sample,
    StepFinished,
    ValidationFinished,
    ValidationRequested,
    WeightsPublished,
)

pytestmark = pytest.mark.asyncio

T = TypeVar("T")
KEYS = RunKeys("loops")
TOKENS = CharTokenizer()
BOUND_S = 10.0  # no loop here needs more than a fraction of a second
Gate = Callable[[], bool]


def _open() -> bool:
    return True


# --------------------------------------------------------------------------- the sources


class ScriptedSource:
    """The rollouters' group as one replica sees it: deliveries handed out in order (each
    once its gate is open), and what it was given back."""

    name = RunKeys.rollouter_consumer(0)

    def __init__(self) -> None:
        self.queue: list[tuple[Gate, Delivery]] = []
        self.answers: list[tuple[str, list[Message], list[str]]] = []  # stream, msgs, acked
        self.acked: list[str] = []
        self.dead: list[tuple[str, str]] = []  # entry id, reason
        self.added: dict[str, Message] = {}

    def add(self, msg: Message, when: Gate = _open) -> str:
        entry_id = f"{len(self.added) + 1}-0"
        self.added[entry_id] = msg
        self.queue.append((when, Delivery(entry_id, msg, 1, KEYS.prompts)))
        return entry_id

    async def read(self, count: int = 64, block_ms: int | None = 1000) -> list[Delivery]:
        await asyncio.sleep(0)
        out: list[Delivery] = []
        while self.queue and len(out) < count and self.queue[0][0]():
            out.append(self.queue.pop(0)[1])
        return out

    async def ack(self, *ids: str | Delivery) -> int:
        self.acked += [i.id if isinstance(i, Delivery) else i for i in ids]
        return len(ids)

    async def publish_and_ack(self, stream: str, msgs: Sequence[Message],
                              *ids: str | Delivery) -> list[str]:
        keys = [i.id if isinstance(i, Delivery) else i for i in ids]
        await asyncio.sleep(0)
        self.answers.append((stream, list(msgs), keys))
        self.acked += keys
        return [f"a{len(self.answers)}-{i}" for i in range(len(msgs))]

    async def dead_letter(self, entry: str | Delivery, reason: str, raw: bytes = b"") -> None:
        self.dead.append((entry.id if isinstance(entry, Delivery) else entry, reason))

    async def dead_letter_many(self, refusals: Sequence[Refusal]) -> int:
        for r in refusals:
            await self.dead_letter(r.entry, r.reason, r.raw)
        return 0

    async def reclaim_from(self, owners: Iterable[str], count: int = 100) -> list[Delivery]:
        return []

    def samples(self) -> dict[str, list[Sample]]:
        """The samples published, by ticket."""
        out: dict[str, list[Sample]] = {}
        for stream, msgs, _ in self.answers:
            for m in msgs:
                if stream == KEYS.samples and isinstance(m, Sample):
                    out.setdefault(m.ticket_id, []).append(m)
        return out

    def answered(self, *entry_ids: str) -> bool:
        return all(i in self.acked or i in {d for d, _ in self.dead} for i in entry_ids)


class ScriptedLog:
    """The run's log: entries released in order, each once its gate is open (an entry waits
    for the ones before it)."""

    def __init__(self) -> None:
        self.script: list[tuple[Gate, Message]] = []
        self.read: list[Message] = []
        self.caught_up = True
        self.position = "0"

    def add(self, *msgs: Message, when: Gate = _open) -> None:
        self.script += [(when, m) for m in msgs]

    def released(self, kind: type, **fields: object) -> bool:
        return any(isinstance(m, kind) and all(getattr(m, k) == v for k, v in fields.items())
                   for m in self.read)

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
    """Exact match of the decoded response with the ground truth."""

    failures: int = 0
    timeouts: int = 0
    scored: int = 0

    async def score(self, items: list[ScoreItem]) -> list[Score]:
        self.scored += len(items)
        return [Score(float(i.solution_str == i.ground_truth), {}, 0.0, False) for i in items]

    def take_warning(self) -> str | None:
        return None

    def fails_ticket(self, data_source: str) -> bool:
        return False

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- the engines


def _next_token(context: Sequence[int]) -> int:
    """A character id (3..16 in the char tokenizer), a function of the tokens so far."""
    return 3 + (sum(context) + len(context)) % 14


@dataclass
class CountingEngine:
    """The batch engine: each token a function of the tokens before it, log-prob -0.5,
    never an eos (responses run to ``max_new_tokens``). A prompt in ``refuse`` fails its
    call. ``calls``: (version held, prompts) of every generate call."""

    name: str = "counting"
    eos_ids: tuple[int, ...] = ()
    version: int = -1
    steps: int = 0
    refuse: set[str] = field(default_factory=set)
    calls: list[tuple[int, list[str]]] = field(default_factory=list)
    streamed: dict[str, list[int]] = field(default_factory=dict)  # the streaming engine's
    log: list[tuple[str, str, int]] = field(default_factory=list)  # what, key, version

    def _check(self, prompt: Sequence[int]) -> None:
        if TOKENS.decode(prompt[1:]) in self.refuse:
            raise ValueError(f"prompt {TOKENS.decode(prompt[1:])!r} refused")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 1.0, eos_id: EosIds = None, *,
                 generator: torch.Generator | None = None, top_p: float = 1.0,
                 top_k: int = -1) -> Generation:
        self.calls.append((self.version, [TOKENS.decode(p[1:]) for p in prompts]))
        # The streamed requests running beside this call (the streaming engine's).
        self.log.append(("generate", str(len(self.streamed)), self.version))
        for p in prompts:
            self._check(p)
        out = []
        for p in prompts:
            seq = list(p)
            for _ in range(max_new_tokens):
                seq.append(_next_token(seq))
            out.append(seq[len(p):])
        self.steps += max_new_tokens
        return Generation(out, [np.full(len(t), -0.5, np.float32) for t in out],
                          [False] * len(out))

    def load_state(self, state: State, version: int) -> None:
        self.version = version
        self.log.append(("load", "", version))

    def close(self) -> None:
        pass


@dataclass
class StreamingCountingEngine(CountingEngine):
    """The streaming engine: the same tokens, one per engine step per request."""

    name: str = "counting-streams"
    budgets: dict[str, int] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        return len(self.streamed)

    def submit(self, key: str, prompt: Sequence[int], max_new_tokens: int,
               temperature: float, eos_id: EosIds, *, generator: torch.Generator | None,
               top_p: float, top_k: int) -> None:
        self._check(prompt)
        self.streamed[key] = list(prompt)
        self.budgets[key] = max_new_tokens
        self.log.append(("submit", key, self.version))

    def advance(self, max_steps: int) -> list[Delta]:
        new: dict[str, list[int]] = {k: [] for k in self.streamed}
        ended: set[str] = set()
        for _ in range(max_steps):
            self.steps += 1
            for key, seq in self.streamed.items():
                token = _next_token(seq)
                seq.append(token)
                new[key].append(token)
                self.budgets[key] -= 1
                if self.budgets[key] == 0:
                    ended.add(key)
            if ended:
                break
        for key in ended:
            del self.streamed[key]
            self.log.append(("ended", key, self.version))
        return [Delta(k, toks, [-0.5] * len(toks), k in ended) for k, toks in new.items()]

    def abort(self) -> list[Delta]:
        for key in self.streamed:
            self.log.append(("aborted", key, self.version))
        self.streamed.clear()
        return []

    def cancel(self, keys: Sequence[str]) -> None:
        for key in keys:
            if self.streamed.pop(key, None) is not None:
                self.log.append(("cancelled", key, self.version))


# --------------------------------------------------------------------------- the context


@dataclass
class Harness:
    cfg: Config
    source: ScriptedSource
    log: ScriptedLog
    engine: CountingEngine
    ctx: RolloutContext
    events: list[Event]
    complaints: list[str]
    fetch_turns: dict[int, int]  # turns of the event loop a version's fetch takes (default 1)

    def loop(self) -> RolloutLoop:
        if isinstance(self.engine, StreamingCountingEngine):
            return ContinuousRollout(self.ctx, self.engine)
        return BatchRollout(self.ctx, self.engine)

    async def run(self) -> None:
        """The rollouter's serve: the first weights, the loop, the last publication."""
        await asyncio.wait_for(self.ctx.weights.first(), BOUND_S)
        await asyncio.wait_for(self.loop().run(), BOUND_S)
        await self.ctx.tickets.delivered()
        await self.ctx.stop()

    def published(self, kind: type[T]) -> list[T]:
        return [e for e in self.events if isinstance(e, kind)]

    def end_when(self, gate: Gate) -> None:
        """The trainer finishes the run (its one step) once ``gate`` holds."""
        self.log.add(StepFinished(step=1, sample_ids=[], metrics={}, duration_s=0.0),
                     RunFinished(run_id="loops", steps=1), when=gate)


async def _off(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """The worker thread, in line: one turn of the loop first (as a thread's hand-off)."""
    await asyncio.sleep(0)
    return fn(*args, **kwargs)


def _harness(kind: str, *overrides: str, val: bool = False) -> Harness:
    cfg = load_config(None, ["trainer.total_training_steps=1", "rollout.prompts_per_batch=2",
                             "rollout.max_new_tokens=6", "rollout.weights_fetch_timeout_s=5",
                             *(["data.val_files=/nowhere/val.parquet"] if val else []),
                             *overrides])
    engine = StreamingCountingEngine() if kind == "continuous" else CountingEngine()
    source, log = ScriptedSource(), ScriptedLog()
    events: list[Event] = []
    complaints: list[str] = []
    fetch_turns: dict[int, int] = {}

    async def publish(*msgs: Event) -> None:
        events.extend(msgs)

    async def fetch(msg: WeightsPublished) -> State:
        for _ in range(fetch_turns.get(msg.version, 1)):  # fetched beside generation
            await asyncio.sleep(0)
        return {"w": torch.full((1,), float(msg.version))}

    async def load(state: State, version: int) -> None:
        await _off(engine.load_state, state, version)

    async def nobody_dead() -> list[str]:
        return []

    async def no_commands() -> None:
        pass

    ctx = RolloutContext(
        cfg, rank=0, keys=KEYS, tokenizer=TOKENS, generator=torch.Generator(), off=_off,
        source=source, log=log, trainer=Present(), fetch=fetch, load=load,
        stranded=lambda msg: False, find_dead=nobody_dead, publish=publish,
        complain=complaints.append, commands=no_commands, profiler=lambda: None,
        rewards=Rewards())
    log.add(_weights(0))
    return Harness(cfg, source, log, engine, ctx, events, complaints, fetch_turns)


def _weights(version: int) -> WeightsPublished:
    return WeightsPublished(version=version, step=version,
                            ref=BlobRef(store="memory", key=f"w{version}", size=1, sha256="0"))


def _ticket(tid: str, prompt: str = "1234>", n: int = 2, min_version: int = 0) -> PromptTicket:
    return PromptTicket(ticket_id=tid, prompt_id=tid, prompt=prompt, answer="4321", n=n,
                        min_version=min_version)


LOOPS = ["batch", "continuous"]


# --------------------------------------------------------------------------- both loops


@pytest.mark.parametrize("kind", LOOPS)
async def test_every_ticket_is_answered_once_samples_then_ack(kind: str) -> None:
    h = _harness(kind)
    ids = [h.source.add(_ticket(f"t{i}", prompt=f"{i}{i}>", n=i + 1)) for i in range(3)]
    h.end_when(lambda: h.source.answered(*ids))
    await h.run()

    by_ticket = h.source.samples()
    assert sorted(by_ticket) == ["t0", "t1", "t2"]
    for i in range(3):
        samples = by_ticket[f"t{i}"]
        assert sorted(s.index for s in samples) == list(range(i + 1))
        assert all(len(s.response_tokens) == len(s.logprobs) == 6 for s in samples)
        assert all((s.min_version, s.max_version) == (0, 0) for s in samples)
    # Each ticket acked once, in the same call that published its samples.
    assert sorted(h.source.acked) == sorted(ids)
    for stream, msgs, acked in h.source.answers:
        assert stream == KEYS.samples
        tickets = [h.source.added[i] for i in acked]
        assert {m.ticket_id for m in msgs if isinstance(m, Sample)} == {
            t.ticket_id for t in tickets if isinstance(t, PromptTicket)}
    assert h.source.dead == [] and h.published(RolloutFailed) == [] and h.complaints == []


@pytest.mark.parametrize("kind", LOOPS)
async def test_the_runs_end_stops_the_loop_before_its_tickets(kind: str) -> None:
    h = _harness(kind)
    h.end_when(_open)
    h.source.add(_ticket("late"))
    await h.run()
    assert h.ctx.finished
    assert h.engine.calls == [], "nothing generated"
    assert not any(what == "submit" for what, _, _ in h.engine.log), "nothing admitted"
    assert h.source.answers == [] and h.source.acked == [], "left for the run's end"


@pytest.mark.parametrize("kind", LOOPS)
async def test_a_failing_generation_is_retried_then_given_up(kind: str) -> None:
    h = _harness(kind)
    h.engine.refuse = {"99>"}
    bad = h.source.add(_ticket("bad", prompt="99>"))
    h.end_when(lambda: h.source.answered(bad))
    await h.run()

    failures = h.published(RolloutFailed)
    assert [f.ticket_id for f in failures] == ["bad"] * MAX_ATTEMPTS
    assert all("refused" in f.error for f in failures)
    assert len(h.source.dead) == 1 and h.source.dead[0][0] == bad
    assert f"rollout failed {MAX_ATTEMPTS} times" in h.source.dead[0][1]
    assert h.source.samples() == {} and bad not in h.source.acked


async def test_a_refused_prompt_fails_alone_in_the_running_engine() -> None:
    h = _harness("continuous")
    h.engine.refuse = {"99>"}
    bad = h.source.add(_ticket("bad", prompt="99>"))
    good = h.source.add(_ticket("good"))
    h.end_when(lambda: h.source.answered(bad, good))
    await h.run()
    assert list(h.source.samples()) == ["good"] and good in h.source.acked
    assert [d for d, _ in h.source.dead] == [bad]


@pytest.mark.parametrize("kind", LOOPS)
async def test_a_validation_request_is_served_between_tickets_and_answered_once(
    kind: str,
) -> None:
    h = _harness(kind, "rollout.val_kwargs.n=2", val=True)
    records = [_Record(i, TOKENS.encode(d + ">", bos=True), d + ">", "digits", d[::-1])
               for i, d in enumerate(["12", "345"])]
    rewards = Rewards()
    h.ctx.validations.validator = Validator(records, rewards.score, h.cfg, TOKENS,
                                            item=ScoreItem)
    t0 = h.source.add(_ticket("t0"))
    request = h.source.add(ValidationRequested(request_id="val-v0", version=0, step=0))
    h.end_when(lambda: h.source.answered(t0, request))
    await h.run()

    answers = [(stream, m, acked) for stream, msgs, acked in h.source.answers for m in msgs
               if isinstance(m, ValidationFinished)]
    assert len(answers) == 1
    stream, fin, acked = answers[0]
    assert (stream, acked) == (KEYS.log("rollouter"), [request])
    assert (fin.request_id, fin.version, fin.rank, fin.error) == ("val-v0", 0, 0, "")
    assert "val-core/digits/reward/mean@2" in fin.metrics
    assert rewards.scored == 4, "every record, val_kwargs.n times"
    assert list(h.source.samples()) == ["t0"]
    assert h.ctx.validations.serving is None
    if kind == "batch":  # after the batch the request was read with
        order = [type(msgs[0]) for _, msgs, _ in h.source.answers]
        assert order == [Sample, ValidationFinished]
    else:  # on the emptied engine: no response running beside it
        assert [running for what, running, _ in h.engine.log if what == "generate"] == ["0"]


@dataclass
class _Record:
    index: int
    prompt_ids: list[int]
    text: str
    data_source: str
    ground_truth: str
    extra_info: dict[str, Any] | None = None


# --------------------------------------------------------------------------- weights


async def test_batch_a_ticket_needing_newer_weights_waits_for_them() -> None:
    h = _harness("batch")
    first = h.source.add(_ticket("t0"))
    # v1 is published once t0 generates; the ticket that needs it is issued after it (the
    # trainer's order), and v1's fetch is still running when the ticket is read.
    h.log.add(_weights(1), when=lambda: len(h.engine.calls) >= 1)
    h.fetch_turns[1] = 50
    needs = h.source.add(_ticket("t1", min_version=1),
                         when=lambda: h.log.released(WeightsPublished, version=1))
    h.end_when(lambda: h.source.answered(first, needs))
    await h.run()

    samples = h.source.samples()
    assert {(s.min_version, s.max_version) for s in samples["t0"]} == {(0, 0)}
    assert {(s.min_version, s.max_version) for s in samples["t1"]} == {(1, 1)}
    assert [v for v, prompts in h.engine.calls if "1234>" in prompts] == [0, 1]


async def test_continuous_a_ticket_needing_newer_weights_waits_for_the_sync() -> None:
    h = _harness("continuous", "rollout.max_new_tokens=24")
    first = h.source.add(_ticket("a"))
    h.log.add(_weights(1), when=lambda: h.engine.steps >= 1)
    needs = h.source.add(_ticket("b", min_version=1),
                         when=lambda: h.log.released(WeightsPublished, version=1))
    h.end_when(lambda: h.source.answered(first, needs))
    await h.run()

    samples = h.source.samples()
    # Without partial rollout, a ends on the weights it started with; b is admitted only
    # once a has ended and v1 is loaded.
    assert {(s.min_version, s.max_version) for s in samples["a"]} == {(0, 0)}
    assert {(s.min_version, s.max_version) for s in samples["b"]} == {(1, 1)}
    log = h.engine.log
    a_ended = max(i for i, (what, key, _) in enumerate(log) if what == "ended"
                  and key.startswith("a#"))
    loaded = log.index(("load", "", 1))
    b_in = [(i, v) for i, (what, key, v) in enumerate(log) if what == "submit"
            and key.startswith("b#")]
    assert a_ended < loaded < min(i for i, _ in b_in) and {v for _, v in b_in} == {1}


async def test_continuous_a_reissued_attempt_ends_the_older_one_in_the_engine() -> None:
    """The trainer reissued ``a`` (attempt 1) and this rollouter claimed it while attempt 0
    runs: attempt 0's requests are ended in the engine (their slots and KV blocks freed, not
    run to their end and ignored), attempt 1 answers the ticket, attempt 0's entry is acked."""
    h = _harness("continuous", "rollout.max_new_tokens=400", "model.max_len=512")
    older = h.source.add(_ticket("a"))
    newer = h.source.add(msgspec.structs.replace(_ticket("a"), attempt=1),
                         when=lambda: h.engine.steps >= 2)
    h.end_when(lambda: h.source.answered(older, newer))
    await h.run()

    log = h.engine.log
    cancelled = [key for what, key, _ in log if what == "cancelled"]
    assert cancelled == ["a#0/0", "a#0/1"], log
    assert not [key for what, key, _ in log if what == "ended" and key.startswith("a#0/")]
    (samples,) = [msgs for _, msgs, acked in h.source.answers if msgs]
    assert {s.attempt for s in samples if isinstance(s, Sample)} == {1}
    assert sorted(h.source.acked) == sorted([older, newer])


@pytest.mark.parametrize("kind", LOOPS)
async def test_partial_rollout_picks_up_new_weights_mid_response(kind: str) -> None:
    h = _harness(kind, "async_training.partial_rollout=true",
                 "rollout.partial_chunk_tokens=2", "rollout.max_new_tokens=24")
    ticket = h.source.add(_ticket("a"))
    h.log.add(_weights(1), when=lambda: h.engine.steps >= 1)
    h.end_when(lambda: h.source.answered(ticket))
    await h.run()

    samples = h.source.samples()["a"]
    assert {(s.min_version, s.max_version) for s in samples} == {(0, 1)}
    assert all(len(s.response_tokens) == 24 for s in samples)
    assert h.ctx.weights.version == h.engine.version == 1


async def test_the_loops_implement_one_interface() -> None:
    h = _harness("batch")
    loops: list[RolloutLoop] = [BatchRollout(h.ctx, h.engine),
                                ContinuousRollout(h.ctx, StreamingCountingEngine())]
    assert [loop.describe() for loop in loops] == [
        None, "0 responses of 0 tickets in the engine, 0 tickets waiting"]


class _RefusingSource(ScriptedSource):
    """Redis refuses the samples' publication (out of memory): the trainer, refused too,
    issues no more tickets."""

    async def publish_and_ack(self, stream: str, msgs: Sequence[Message],
                              *ids: str | Delivery) -> list[str]:
        await asyncio.sleep(0)
        raise RuntimeError("redis is out of memory")


@pytest.mark.asyncio
async def test_a_failed_publication_is_raised_by_the_next_read_of_tickets() -> None:
    """The last batch's publication fails in the background and no ticket is left to
    answer: the replica's next look for tickets raises it (its one line), never a wait
    that ends as "trainer is gone" (test_named_faults' maxmemory case, seen in make test)."""
    from rollouter.tickets import TicketDesk

    async def nothing() -> None:
        return None

    async def publish(_: object) -> None:
        return None

    async def no_dead() -> list[str]:
        return []

    desk = TicketDesk(_RefusingSource(), KEYS.samples, rank=0, batch=8, poll=nothing,
                      publish=publish, validates=False, find_dead=no_dead)

    async def answers() -> tuple[list[tuple[str, PromptTicket]], dict[str, list[Sample]]]:
        ticket = PromptTicket(ticket_id="t0", prompt_id="p0", prompt="1", answer="1", n=1,
                              min_version=0)
        tokens = Array.of(np.asarray([1], dtype=np.int32))
        sample = Sample(sample_id="t0/0", ticket_id="t0", prompt_id="p0", index=0, n=1,
                        prompt_tokens=tokens, response_tokens=tokens,
                        logprobs=Array.of(np.asarray([-0.1], dtype=np.float32)), reward=1.0,
                        min_version=0, max_version=0)
        return [("1-0", ticket)], {"t0": [sample]}

    await desk.deliver_later(answers())
    await asyncio.sleep(0.01)  # the background publication fails meanwhile
    with pytest.raises(RuntimeError, match="out of memory"):
        await desk.next()
    assert desk.delivering is None  # raised once
