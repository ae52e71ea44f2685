"""Validation on the bus: when the trainer asks (verl's rule, in parameter versions), how a
rollouter serves a request between its batches (once per request id, with weights at least as
new as asked), and how inspect, the progress lines, the summary and the logger show it.

The verl records and the scoring pool are built by tasks.verl_data and rollouter.scoring; here
the test builds records of the digits task itself and scores them with the digits reward,
through the same interfaces (Validator takes both as arguments)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from bus import Bus, Lease, RunKeys
from metrics_logger import MetricsLogger, tensorboard_dir
from metrics_logger.app import TensorBoardSink
from rlbus.inspect import summary_line, validations_table
from rlbus.watching import Summary
from rollouter.app import Rollouter
from rollouter.batch import BatchRollout
from rollouter.validation import Validator, sampling, val_generate
from runconfig import Config, load_config
from runschema.messages import (
    DeadLetter,
    PromptTicket,
    RunFinished,
    RunStarted,
    Sample,
    StepFinished,
    ValidationFinished,
    ValidationRequested,
    WeightsPublished,
    encode,
)
from runtime.progress import val_core_reward, validation_line
from tasks.digits import digits_reward
from tests.procs import events_of
from trainer.validation import (
    ValidationRequests,
    Validations,
    last_version,
    request_id,
    validation_due,
)
from trainer.watch import Watch
from trainer.writer import Writer
from weights.blobs import RedisBlobStore

# --------------------------------------------------------------------------- stand-ins
# (the shapes of tasks.verl_data.VerlRecord and rollouter.scoring.ScoreItem / Score)


@dataclass
class _Record:
    index: int
    prompt_ids: list[int]
    text: str
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] | None = None


@dataclass
class _Item:
    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] | None
    response_len: int


@dataclass
class _Score:
    reward: float
    extra: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    failed: bool = False


class _Scorer:
    """The digits reward with verl's dict form (``exact`` as an extra key); remembers what
    it was given."""

    def __init__(self) -> None:
        self.items: list[_Item] = []

    async def __call__(self, items: list[_Item]) -> list[_Score]:
        self.items.extend(items)
        return [_Score(digits_reward(i.solution_str, str(i.ground_truth)),
                       {"exact": float(i.solution_str == i.ground_truth)}) for i in items]


def _cfg(tmp_path: Path, *extra: str, redis_url: str = "redis://unused", run_id: str = "t-x"
         ) -> Config:
    return load_config(overrides=[f"redis.url={redis_url}", f"run.id={run_id}",
                                  f"run.output_dir={tmp_path}",
                                  "data.val_files=val.parquet", *extra])


# --------------------------------------------------------------------------- the trainer's rule


def _schedule(cfg: Config) -> list[tuple[int, int]]:
    """(version, step) of every validation the trainer asks for in a run of ``cfg``: weights
    version 0 before training, then one version per trigger_parameter_sync_step updates."""
    trigger = cfg.async_training.trigger_parameter_sync_step
    total = cfg.trainer.total_training_steps
    asked = [(0, 0)] if validation_due(0, cfg, last_version(0, trigger, total)) else []
    version = 0
    for step in range(1, total + 1):
        if step % trigger == 0:
            version += 1
            if validation_due(version, cfg, last_version(step, trigger, total)):
                asked.append((version, step))
    return asked


@pytest.mark.parametrize(("trigger", "total", "freq", "expected"), [
    (1, 6, 2, [(0, 0), (2, 2), (4, 4), (6, 6)]),
    (1, 5, 2, [(0, 0), (2, 2), (4, 4), (5, 5)]),  # and the last version
    (2, 10, 2, [(0, 0), (2, 4), (4, 8), (5, 10)]),  # every 2 versions = every 4 updates
    (4, 10, 1, [(0, 0), (1, 4), (2, 8)]),  # v2 (after update 8) is the last published
    (4, 20, 3, [(0, 0), (3, 12), (5, 20)]),
    (2, 6, -1, [(0, 0)]),  # test_freq <= 0: before training only
])
def test_validation_is_due_every_test_freq_parameter_versions(
    tmp_path: Path, trigger: int, total: int, freq: int, expected: list[tuple[int, int]]
) -> None:
    cfg = _cfg(tmp_path, f"async_training.trigger_parameter_sync_step={trigger}",
               f"trainer.total_training_steps={total}", f"trainer.test_freq={freq}")
    assert _schedule(cfg) == expected


def test_val_before_train_and_val_files_gate_validation(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "trainer.val_before_train=false", "trainer.test_freq=2",
               "trainer.total_training_steps=4")
    assert _schedule(cfg) == [(2, 2), (4, 4)]
    no_files = load_config(overrides=["trainer.test_freq=1", "trainer.total_training_steps=4"])
    assert _schedule(no_files) == [], "no data.val_files: nothing to validate"
    assert request_id(3) == "val-v3"


@pytest.mark.asyncio
async def test_the_trainer_writes_requests_to_the_prompts_stream_and_awaits_their_answers(
    bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, "trainer.test_freq=2", run_id=run_id)
    lease = Lease(bus, run_keys.trainer_lease, "tok", 30.0)
    assert await lease.acquire() is None
    writer = Writer(bus, run_keys, lease)
    validations = Validations(cfg, bus, run_keys, writer)
    requests = ValidationRequests(cfg)  # the trainer's step core decides them
    for version in (0, 1, 2):
        request = requests.due(version, step=version * 3, last=False)
        if request is not None:
            await validations.request(request)
    asked = [m async for _, m in bus.read_all(run_keys.prompts)]
    assert asked == [ValidationRequested(request_id="val-v0", version=0, step=0, ts=asked[0].ts),
                     ValidationRequested(request_id="val-v2", version=2, step=6, ts=asked[1].ts)]
    assert set(requests.pending) == {"val-v0", "val-v2"}
    # Not tickets: a dead-lettered request never touches the trainer's ledger.
    watch = Watch(cfg, bus, run_keys)
    watch._fold_dead([("1-0", DeadLetter(source_stream=run_keys.prompts, entry_id="1-0",
                                         reason="test", raw=encode(asked[0])))])
    assert watch.take_dead_tickets() == []
    # The answers are read from the rollouters' stream (the run's end awaits them).
    await bus.publish_many(run_keys.log("rollouter"), [
        ValidationFinished(request_id=f"val-v{v}", version=v, step=3 * v, rank=0,
                           metrics={"val-core/s/reward/mean@1": 0.5}) for v in (0, 2)])
    await validations.poll(block_ms=100)
    assert requests.answered(validations.take())
    assert not requests.pending and requests.done == {"val-v0", "val-v2"}


# --------------------------------------------------------------------------- the rollouter


async def _publish_weights(bus: Bus, keys: RunKeys, version: int, blob: bytes) -> None:
    ref = await RedisBlobStore(bus, keys).put(f"weights-v{version}-test", blob)
    await bus.publish(keys.events, WeightsPublished(version=version, ref=ref, step=version))


def _records(r: Rollouter) -> list[_Record]:
    rows = [("1234", "digits/a"), ("5678", "digits/a"), ("9012", "digits/b"),
            ("3456", "digits/b"), ("7890", "digits/b")]
    return [_Record(i, r.tokenizer.encode(d + ">", bos=True), d + ">", src, d[::-1],
                    {"index": i}) for i, (d, src) in enumerate(rows)]


def _rollouter(cfg: Config, bus: Bus) -> Rollouter:
    r = Rollouter(cfg, bus)
    r.build()
    return r


async def _pending(bus: Bus, keys: RunKeys) -> int:
    return next(g.pending for g in await bus.groups(keys.prompts) if g.name == "rollouter")


async def _serve_all(r: Rollouter) -> None:
    """What the ticket loop does with one read: the batch, then the requests read with it."""
    deliveries: list[Any] = []
    while not deliveries:  # the read ahead of the last batch may hold them
        deliveries, polled = await r.context.tickets.next()
    assert r.engine is not None
    await BatchRollout(r.context, r.engine).serve(deliveries, polled)
    await r.context.validations.serve(r.engine)
    await r.context.tickets.delivered()


@pytest.mark.asyncio
async def test_a_rollouter_serves_a_request_between_batches_once(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, "rollout.val_kwargs.n=2", "trainer.log_val_generations=3",
               "rollout.prompts_per_batch=2", redis_url=redis_url, run_id=run_id)
    r = _rollouter(cfg, bus)
    scorer = _Scorer()
    r.context.validations.validator = Validator(_records(r), scorer, cfg, r.tokenizer, item=_Item)
    newer = _rollouter(cfg, bus).engine.policy
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(0.3)
    await _publish_weights(bus, run_keys, 0, r.engine.policy.state_bytes())
    await _publish_weights(bus, run_keys, 1, newer.state_bytes())
    await r.consumer.ensure_group()
    await bus.publish(run_keys.prompts, PromptTicket(
        ticket_id="t0", prompt_id="p0", prompt="1234>", answer="4321", n=2, min_version=0))
    await bus.publish(run_keys.prompts, ValidationRequested(request_id="val-v0", version=0,
                                                            step=0))
    await _serve_all(r)

    samples = [m async for _, m in bus.read_all(run_keys.samples) if isinstance(m, Sample)]
    assert [s.sample_id for s in samples] == ["t0/0", "t0/1"], "the batch was served too"
    done = [e for e in await events_of(bus, run_keys.events) if isinstance(e, ValidationFinished)]
    assert len(done) == 1
    fin = done[0]
    assert (fin.request_id, fin.version, fin.step, fin.rank, fin.error) == ("val-v0", 1, 0, 0,
                                                                            "")
    # Every record, val_kwargs.n times, greedy (do_sample false): both responses alike.
    assert len(scorer.items) == 10
    assert [i.ground_truth for i in scorer.items[:2]] == ["4321", "4321"]
    assert scorer.items[0].extra_info == {"index": 0}
    for a, b in zip(scorer.items[::2], scorer.items[1::2], strict=True):
        assert a.solution_str == b.solution_str
    for src in ("digits/a", "digits/b"):
        assert f"val-core/{src}/reward/mean@2" in fin.metrics
        assert f"val-core/{src}/reward/best@2/mean" in fin.metrics
        assert fin.metrics[f"val-aux/{src}/reward/std@2"] == 0.0
        assert f"val-aux/{src}/exact/mean@2" in fin.metrics
    assert len(fin.generations) == 3
    assert {g[0] for g in fin.generations} <= {rec.text for rec in _records(r)}
    assert await _pending(bus, run_keys) == 0, "the request and the ticket were acked"

    # A second delivery of the same request (e.g. the trainer resumed and asked again).
    await bus.publish(run_keys.prompts, ValidationRequested(request_id="val-v0", version=0,
                                                            step=0))
    await _serve_all(r)
    done = [e for e in await events_of(bus, run_keys.events) if isinstance(e, ValidationFinished)]
    assert len(done) == 1 and len(scorer.items) == 10, "acked without work"
    assert await _pending(bus, run_keys) == 0
    await r.context.stop()
    r.worker.shutdown()


@pytest.mark.asyncio
async def test_a_failed_validation_is_an_answer_never_a_dead_rollouter(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, redis_url=redis_url, run_id=run_id)
    r = _rollouter(cfg, bus)
    await bus.command("SET", run_keys.trainer_lease, "tok", "PX", 60_000)  # a live trainer
    await _publish_weights(bus, run_keys, 0, r.engine.policy.state_bytes())

    async def broken(items: list[_Item]) -> list[_Score]:
        raise RuntimeError("the scorer is down")

    r.context.validations.validator = Validator(_records(r), broken, cfg, r.tokenizer, item=_Item)
    await r.consumer.ensure_group()
    # Weights the log does not hold (the trainer publishes them before asking: a lost
    # stretch of log), then a scorer that raises.
    for version in (5, 0):
        await bus.publish(run_keys.prompts, ValidationRequested(
            request_id=request_id(version), version=version, step=version))
    await _serve_all(r)
    fin = {e.request_id: e for e in await events_of(bus, run_keys.events)
           if isinstance(e, ValidationFinished)}
    assert set(fin) == {"val-v5", "val-v0"}
    assert "weights v5 are not in the log" in fin["val-v5"].error
    assert "the scorer is down" in fin["val-v0"].error and fin["val-v0"].metrics == {}
    assert await _pending(bus, run_keys) == 0
    await r.context.stop()
    r.worker.shutdown()


def test_sampling_follows_val_kwargs_and_top_p_goes_only_where_taken(tmp_path: Path) -> None:
    assert sampling(_cfg(tmp_path, "rollout.val_kwargs.temperature=0.7")) == {
        "temperature": 0.0}, "do_sample false is greedy"
    cfg = _cfg(tmp_path, "rollout.val_kwargs.do_sample=true",
               "rollout.val_kwargs.temperature=0.7", "rollout.val_kwargs.top_p=0.9",
               "rollout.val_kwargs.top_k=5")
    params = sampling(cfg)
    assert params == {"temperature": 0.7, "top_p": 0.9, "top_k": 5}
    from policy import build_policy

    policy = build_policy({"kind": "tiny"}, "cpu")

    class WithTopP:
        """The tiny policy behind a generate that takes top_p and top_k."""

        device = policy.device

        def __init__(self) -> None:
            self.seen: list[tuple[float, float, int]] = []

        def generate(self, prompts: Any, max_new_tokens: int, temperature: float = 1.0,
                     eos_id: int | None = None, generator: Any = None, top_p: float = 1.0,
                     top_k: int = -1) -> Any:
            self.seen.append((temperature, top_p, top_k))
            return policy.generate(prompts, max_new_tokens, temperature, eos_id,
                                   generator=generator)

    wrapped = WithTopP()
    out = val_generate(wrapped, [[1, 5, 6]], 3, None, params, torch.Generator().manual_seed(0))
    assert wrapped.seen == [(0.7, 0.9, 5)] and 1 <= len(out[0]) <= 3
    # The policies' own generate takes them (policy.decode_loop): passed through.
    taken = val_generate(policy, [[1, 5, 6]], 3, None, params, torch.Generator().manual_seed(0))
    direct = policy.generate([[1, 5, 6]], 3, 0.7, None, generator=torch.Generator().manual_seed(0),
                             top_p=0.9, top_k=5)
    assert taken == direct.tokens


# --------------------------------------------------------------------------- shown


def _finished(version: int, step: int, mean: float) -> ValidationFinished:
    return ValidationFinished(request_id=f"val-v{version}", version=version, step=step, rank=0,
                              metrics={"val-core/a/reward/mean@1": mean,
                                       "val-core/b/reward/mean@1": mean / 2,
                                       "val-aux/a/exact/mean@1": 0.1},
                              generations=[("p", "r", 1.0)], duration_s=1.5)


def test_inspect_progress_and_summary_show_the_val_core_reward() -> None:
    ev = _finished(2, 4, 0.8)
    assert val_core_reward(ev.metrics) == pytest.approx(0.6)
    line = validation_line(ev)
    assert line.startswith("validation v2 (step 4): ")
    assert "val-core/a/reward/mean@1 0.800" in line and "val-aux" not in line
    assert "ValidationFinished" in summary_line("1700000000000-0", ev)
    table = validations_table([("1-0", RunStarted(run_id="r", config={})),
                               ("2-0", _finished(0, 0, 0.1)), ("3-0", ev)])
    assert table[0] == "validations:" and len(table) == 3
    assert "v2" in table[2] and "step 4" in table[2]
    assert "val-core/a/reward/mean@1=0.8000" in table[2] and "val-aux" not in table[2]
    failed = ValidationFinished(request_id="val-v3", version=3, step=6, rank=1, metrics={},
                                error="boom")
    assert "failed: boom" in validation_line(failed) and "failed: boom" in validations_table(
        [("1-0", failed)])[1]
    summary = Summary()
    summary.validated(_finished(0, 0, 0.1))
    summary.validated(ev)
    summary.validated(failed)  # no metrics: the latest figures stay
    assert "val-core reward 0.600 (weights v2, step 4)" in summary.line("r", 10, 1.0)


def test_the_trace_draws_a_validation_on_its_rollouter() -> None:
    from rlbus.trace import build_trace

    ev = _finished(2, 4, 0.8)
    tree = build_trace("r", [RunStarted(run_id="r", config={}, ts=ev.ts - 10), ev])
    spans = [e for e in tree["traceEvents"] if e.get("cat") == "validation"]
    assert len(spans) == 1 and spans[0]["name"] == "validate weights v2"
    assert spans[0]["dur"] == pytest.approx(1.5e6, rel=1e-3)
    assert spans[0]["args"]["val-core/a/reward/mean@1"] == 0.8


@pytest.mark.asyncio
async def test_the_logger_writes_validation_metrics_at_the_requested_step(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, [f"run.id={run_id}", f"run.output_dir={tmp_path}"])
    steps = [StepFinished(step=k, sample_ids=[], duration_s=0.1, metrics={"critic/score/mean": k})
             for k in (1, 2, 3)]
    keys = RunKeys(run_id)
    for msg in [RunStarted(run_id=run_id, config={}), _finished(0, 0, 0.1), *steps[:2],
                _finished(1, 1, 0.4), steps[2], _finished(2, 3, 0.9),
                RunFinished(run_id=run_id, steps=3)]:
        # The answers are the rollouters' facts, the rest the trainer's: one log, two streams.
        role = "rollouter" if isinstance(msg, ValidationFinished) else "trainer"
        await bus.publish(keys.log(role), msg)
    logger = MetricsLogger(cfg, bus, [TensorBoardSink(tensorboard_dir(cfg))])
    assert await logger.run() == 0
    acc = EventAccumulator(str(tensorboard_dir(cfg)))
    acc.Reload()
    points = [(e.step, round(e.value, 3)) for e in acc.Scalars("val-core/a/reward/mean@1")]
    assert points == [(0, 0.1), (1, 0.4), (3, 0.9)]
    assert [e.step for e in acc.Scalars("critic/score/mean")] == [1, 2, 3]


# --------------------------------------------------------------------------- a whole run


@pytest.mark.asyncio
async def test_a_run_validates_its_versions_without_waiting_and_finishes_with_the_last(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    """Trainer and rollouter (in this process, the rollouter's validator given): T=2,
    test_freq=1, 6 updates: weights v0 before training, v1..v3 as they are published; the
    last answer is in the log before RunFinished."""
    from tests.procs import FAST
    from trainer.app import Trainer

    cfg = _cfg(tmp_path, *FAST, "run.retention=all", "async_training.trigger_parameter_sync_step=2",
               "trainer.total_training_steps=6", "trainer.test_freq=1",
               "rollout.val_kwargs.n=2", redis_url=redis_url, run_id=run_id)
    rollouter = Rollouter(cfg, bus)
    scorer = _Scorer()
    records = [_Record(i, rollouter.tokenizer.encode(f"{d}>", bos=True), f"{d}>", "digits",
                       d[::-1]) for i, d in enumerate(["1234", "4321", "5555"])]
    rollouter.context.validations.validator = Validator(records, scorer, cfg,
                                                        rollouter.tokenizer, item=_Item)
    trainer = Trainer(cfg, bus)
    assert await asyncio.gather(trainer.run(), rollouter.run()) == [0, 0]

    events = await events_of(bus, run_keys.events)
    kinds = [type(e).__name__ for e in events]
    answers = [e for e in events if isinstance(e, ValidationFinished)]
    assert [(a.request_id, a.step) for a in answers] == [
        ("val-v0", 0), ("val-v1", 2), ("val-v2", 4), ("val-v3", 6)]
    assert all(a.version >= int(a.request_id[5:]) and not a.error for a in answers)
    assert all("val-core/digits/reward/mean@2" in a.metrics for a in answers)
    assert kinds.index("RunFinished") > max(i for i, k in enumerate(kinds)
                                            if k == "ValidationFinished")
    assert len(scorer.items) == 4 * 3 * 2
    asked = [m async for _, m in bus.read_all(run_keys.prompts)
             if isinstance(m, ValidationRequested)]
    assert [(m.version, m.step) for m in asked] == [(0, 0), (1, 2), (2, 4), (3, 6)]
    assert max(e.step for e in events if isinstance(e, StepFinished)) == 6
