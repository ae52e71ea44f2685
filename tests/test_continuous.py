"""Continuous admission on vLLM (rollouter.continuous): a rollouter, in this process, on a real
Redis and a real vLLM engine (the chat demo's model), serving tickets the test writes.

What batches could not do: a ticket claimed while another is generating starts at once,
beside it, and each ticket is published when its own responses end. At a sync with partial
rollout the running responses are aborted and resumed with the new weights (their samples
span two versions); without it they end on the weights they started with.

Skipped, with the reason printed, in a venv without vLLM (``make vllm`` installs it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus import Bus, RunKeys
from rollouter.app import Rollouter
from rollouter.continuous import ContinuousRollout
from rollouter.engine import Delta, StreamingEngine, streams, vllm_installed
from runconfig import load_config
from runschema.messages import PromptTicket, Sample, WeightsPublished
from tests.procs import events_of
from tests.waits import wait_until
from weights.blobs import RedisBlobStore

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio,
    pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make vllm)"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

ROOT = Path(__file__).resolve().parents[1]
LONG = 256  # response tokens: every response runs to its end (no eos ends one here)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tasks.chatdemo import build_demo

    return build_demo(tmp_path_factory.mktemp("continuous-demo"), n_train=16, n_val=4)


@pytest_asyncio.fixture
async def rollouter(request: pytest.FixtureRequest, demo: Path, redis_url: str, bus: Bus,
                    run_id: str, tmp_path: Path) -> AsyncIterator[Rollouter]:
    """A vLLM rollouter holding weights v0; ``partial`` (the test's parameter) sets
    async_training.partial_rollout."""
    cfg = load_config(ROOT / "configs" / "chat_demo.yaml", overrides=[
        f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}",
        f"actor_rollout_ref.model.path={demo / 'model'}",
        f"data.train_files={demo / 'train.parquet'}", "data.val_files=null",
        f"custom_reward_function.path={demo / 'reward.py'}",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
        f"data.max_response_length={LONG}", "rollout.prompts_per_batch=1",
        # No trainer here: the rollouter's wait for its lease outlasts the test (building
        # the engine alone took 49 s on a loaded machine; the default bound is 30 s).
        "heartbeat.timeout_s=600",
        f"async_training.partial_rollout={str(request.param).lower()}"])
    r = Rollouter(cfg, bus)
    engine = await r.off(r.build)
    await r.consumer.ensure_group()
    await _publish(r, 0)
    await r.context.weights.first()
    try:
        yield r
    finally:
        await r.context.stop()
        r.context.scorer.close()  # the reward pool's worker processes
        await r.off(engine.close)
        r.worker.shutdown()


async def _publish(r: Rollouter, version: int) -> None:
    """The rollouter's own weights as ``version`` (what the trainer publishes: a state blob)."""
    from policy.hf import HFPolicy

    policy = HFPolicy.from_pretrained(r.cfg.model.path, device="cpu")
    ref = await RedisBlobStore(r.bus, r.keys).put(f"weights-v{version}-test",
                                                  policy.state_bytes())
    await r.bus.publish(r.keys.events, WeightsPublished(version=version, ref=ref, step=version))


async def _ticket(bus: Bus, keys: RunKeys, tid: str, min_version: int = 0) -> None:
    await bus.publish(keys.prompts, PromptTicket(
        ticket_id=tid, prompt_id=tid, prompt="What is 12 + 30?", answer="42", n=2,
        min_version=min_version))


async def _until(what: str, check: Callable[[], bool], timeout_s: float = 120.0) -> None:
    """Wait (bounded) for ``check()`` to hold; fails naming ``what``."""
    await wait_until(lambda: True if check() else None, what, timeout_s)


async def _samples(bus: Bus, keys: RunKeys, count: int) -> dict[str, list[Sample]]:
    """The samples published so far, once there are ``count``, by ticket."""

    async def probe() -> list[Sample] | None:
        got = [m for m in await events_of(bus, keys.samples) if isinstance(m, Sample)]
        return got if len(got) >= count else None

    by_ticket: dict[str, list[Sample]] = {}
    for s in await wait_until(probe, f"{count} samples", 120):
        by_ticket.setdefault(s.ticket_id, []).append(s)
    return by_ticket


class Held:
    """``engine`` steps nothing (each slice is empty) once ``hold()`` holds, until
    :meth:`release`: what the test does mid-generation (a ticket, a publication) happens
    there however long it takes, instead of racing the responses' remaining steps."""

    def __init__(self, engine: StreamingEngine, hold: Callable[[], bool]) -> None:
        self.advance = engine.advance
        self.hold = hold
        self.released = threading.Event()
        engine.advance = self  # type: ignore[assignment]

    def __call__(self, steps: int) -> list[Delta]:  # on the rollouter's worker thread
        if self.hold() and not self.released.is_set():
            self.released.wait(0.01)
            return []
        return self.advance(steps)

    def release(self) -> None:
        self.released.set()


async def _serving(r: Rollouter) -> tuple[ContinuousRollout, asyncio.Task[None]]:
    assert streams(r.engine)
    loop = ContinuousRollout(r.context, r.engine)
    # No eos ends a response: each takes LONG engine steps (what a test does mid-generation
    # holds them there: Held).
    loop.eos_ids = []
    return loop, asyncio.create_task(loop.run())


async def _stop(r: Rollouter, task: asyncio.Task[None]) -> None:
    r.context.events.finished = True
    await asyncio.wait_for(task, 60)


@pytest.mark.parametrize("rollouter", [False], indirect=True)
async def test_a_ticket_claimed_mid_generation_joins_the_running_engine(
    rollouter: Rollouter, bus: Bus, run_keys: RunKeys,
) -> None:
    r = rollouter
    loop, task = await _serving(r)
    held = Held(loop.engine, lambda: _generated(loop, "a") >= 8)
    await _ticket(bus, run_keys, "a")
    await _until("8 tokens of ticket a", lambda: _generated(loop, "a") >= 8)
    await _ticket(bus, run_keys, "b")
    try:
        await _until("ticket b in the engine", lambda: "b" in loop.book.groups)
        assert 8 <= _generated(loop, "a") < LONG  # a is still generating beside it
        r.loop = loop
        assert "4 responses of 2 tickets in the engine" in r.heartbeat().state
    finally:
        held.release()
    by_ticket = await _samples(bus, run_keys, 4)
    await _stop(r, task)
    a, b = by_ticket["a"], by_ticket["b"]
    a_start, a_end = a[0].ts - a[0].gen_time_s, a[0].ts
    b_start, b_end = b[0].ts - b[0].gen_time_s, b[0].ts
    # b started while a was generating (a batch would have waited for a's end), and each
    # ticket was published when its own responses ended: a first.
    assert a_start < b_start < a_end < b_end, (a_start, b_start, a_end, b_end)
    for s in a + b:
        assert len(s.response_tokens) == len(s.logprobs) == LONG
        assert (s.min_version, s.max_version) == (0, 0)


def _generated(loop: ContinuousRollout, tid: str) -> int:
    """The fewest tokens a response of ticket ``tid`` in the engine has so far (0: not in
    the engine, before or after)."""
    group = loop.book.groups.get(tid)
    return 0 if group is None else min(len(s.tokens) for s in group.seqs)


@pytest.mark.parametrize("rollouter", [True, False], indirect=True)
async def test_a_sync_resumes_running_responses_with_partial_rollout_only(
    rollouter: Rollouter, bus: Bus, run_keys: RunKeys,
) -> None:
    r = rollouter
    partial = r.cfg.async_training.partial_rollout
    loop, task = await _serving(r)
    held = Held(loop.engine, lambda: _generated(loop, "a") >= 8)
    await _ticket(bus, run_keys, "a")
    await _until("8 tokens of ticket a", lambda: _generated(loop, "a") >= 8)
    try:
        await _publish(r, 1)
        await _ticket(bus, run_keys, "b", min_version=1)
        if partial:  # a, mid-generation, is aborted for the sync (without, the sync waits)
            await _until("the sync to v1", lambda: r.context.weights.version == 1)
    finally:
        held.release()
    by_ticket = await _samples(bus, run_keys, 4)
    await _stop(r, task)
    assert r.engine is not None
    assert r.context.weights.version == 1 and r.engine.version == 1
    a, b = by_ticket["a"], by_ticket["b"]
    if partial:  # aborted at the sync, resumed with v1 from the tokens so far
        assert {(s.min_version, s.max_version) for s in a} == {(0, 1)}
    else:  # ended on the weights it started with; b waited for the sync
        assert {(s.min_version, s.max_version) for s in a} == {(0, 0)}
        assert b[0].ts - b[0].gen_time_s >= a[0].ts
    assert {(s.min_version, s.max_version) for s in b} == {(1, 1)}
    for s in a + b:
        assert len(s.response_tokens) == len(s.logprobs) == LONG
