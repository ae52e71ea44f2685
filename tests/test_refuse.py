"""Readers refuse facts that contradict the log (issue 22): pure folds, tested without Redis.

Each forgery measured on a live run has its test here: a StepFinished that skips steps or
trains no batch, a RunFinished that does not say the last finished step, a TicketsClosed
of tickets not open, a CheckpointSaved of another step; and the real logs the trainer
writes (duplicates of its writes, a step replayed after a crash) still fold. The rollouter's
weights: a publication whose blob is missing is told (``weights_unloadable``), and no fetch
is left to fail unseen.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import msgspec
import pytest

from bus import BlobNotFound
from rlbus.runlog import RunStatus
from rollouter.weights import BLOBS_KEPT, HeldWeights
from runschema.facts import run_finished_refusal
from runschema.messages import (
    BlobRef,
    CheckpointSaved,
    Message,
    RunFinished,
    RunForked,
    RunStarted,
    StepFinished,
    TicketsClosed,
    TicketsIssued,
    WarningRaised,
    WeightsPublished,
)
from trainer.ledger import refusal as ledger_refusal
from trainer.ledger import ticket_id
from trainer.resume import ResumeFailed, pick_checkpoint
from trainer.state import TrainerState, fold, refusal

N = 2  # responses per ticket
TICKETS_PER_STEP = 2


def _issued(first: int, count: int, attempt: int = 0) -> TicketsIssued:
    return TicketsIssued(ticket_ids=[ticket_id(i) for i in range(first, first + count)], n=N,
                         param_version=0, attempt=attempt)


def _finished(step: int, tickets: list[int] | None = None) -> StepFinished:
    tickets = tickets if tickets is not None else _tickets(step)
    ids = [f"{ticket_id(t)}/{i}" for t in tickets for i in range(N)]
    return StepFinished(step=step, sample_ids=ids, metrics={}, duration_s=0.1,
                        entry_ids=[f"{step}-{i}" for i in range(len(ids))])


def _tickets(step: int) -> list[int]:
    return list(range((step - 1) * TICKETS_PER_STEP, step * TICKETS_PER_STEP))


def _saved(step: int, folder: str = "ckpt") -> CheckpointSaved:
    return CheckpointSaved(step=step, path=f"{folder}/step-{step:06d}.pt", param_version=step)


def _run(steps: int, save_freq: int = 0) -> list[Message]:
    """A log as the trainer writes it: tickets one step ahead, checkpoints before their
    StepFinished, RunFinished after the last one."""
    log: list[Message] = [RunStarted(run_id="r", config={"trainer": {"total_training_steps":
                                                                     steps}}),
                          _issued(0, TICKETS_PER_STEP)]
    for k in range(1, steps + 1):
        log.append(_issued(k * TICKETS_PER_STEP, TICKETS_PER_STEP))
        if save_freq and k % save_freq == 0:
            log.append(_saved(k))
        log.append(_finished(k))
    log.append(RunFinished(run_id="r", steps=steps))
    return log


def _fold(log: list[Message]) -> tuple[TrainerState, list[str]]:
    refused: list[str] = []
    state = fold(log, refused=lambda msg, why: refused.append(f"{type(msg).__name__}: {why}"))
    return state, refused


# --------------------------------------------------------------------------- real logs


def test_a_real_log_folds_with_no_refusal() -> None:
    state, refused = _fold(_run(10, save_freq=4))
    assert refused == []
    assert (state.last_step, state.finished) == (10, True)
    assert state.checkpoint() == (8, "ckpt/step-000008.pt")


def test_copies_of_the_trainers_writes_are_passed_over_not_refused() -> None:
    """At-least-once writes: a retried write can land twice, each event right after itself."""
    log = _run(6, save_freq=3)
    doubled = [e for msg in log for e in (msg, msg)]
    state, refused = _fold(doubled)
    assert refused == []
    assert state == fold(log)


def test_a_step_replayed_after_a_crash_folds() -> None:
    """A trainer that saved step 3 and died before its StepFinished trains step 3 again
    after a resume: the second CheckpointSaved(3) and StepFinished(3) fold."""
    log = _run(2)[:-1]
    log += [_issued(6, 2), _saved(3)]  # the crash: no StepFinished(3)
    log += [RunStarted(run_id="r", config={}, resumed=True), _saved(3), _finished(3)]
    state, refused = _fold(log)
    assert refused == []
    assert state.last_step == 3 and state.checkpoint() == (3, "ckpt/step-000003.pt")


# --------------------------------------------------------------------------- forgeries


def test_a_forged_run_finished_is_refused() -> None:
    log = [*_run(24)[:-1], RunFinished(run_id="r", steps=10**9)]
    state, refused = _fold(log)
    assert not state.finished
    assert refused == ["RunFinished: RunFinished(steps=1000000000) does not match the last "
                       "finished step (24)"]
    assert refusal(fold(_run(0)[:-1]), RunFinished(run_id="r", steps=0)) is not None


def test_a_forged_step_finished_without_samples_is_refused_and_the_real_one_folds() -> None:
    log = _run(5)[:-1]
    forged = StepFinished(step=6, sample_ids=[], metrics={}, duration_s=0.0)
    state, refused = _fold([*log, forged, _finished(6)])
    assert refused == ["StepFinished: StepFinished(6) trained no sample (a step trains a "
                       "batch)"]
    assert state.last_step == 6
    assert state.steps[-1].sample_ids == tuple(_finished(6).sample_ids)


@pytest.mark.parametrize(("forged", "why"), [
    (_finished(8, [10, 11]), "skips steps"),
    (_finished(6, [0, 1]), "not an answer of an open ticket"),  # trained at step 1
    (_finished(6, [99]), "not an answer of an open ticket"),  # never issued
    (StepFinished(step=6, sample_ids=["t10/5"], metrics={}, duration_s=0.0),
     "not an answer of an open ticket"),  # index >= n
    (StepFinished(step=6, sample_ids=["t10/0", "t10/0"], metrics={}, duration_s=0.0),
     "names a sample twice"),
    (StepFinished(step=6, sample_ids=["t10/0"], metrics={}, duration_s=0.0,
                  entry_ids=["1-0", "1-1"]), "entry ids"),
])
def test_step_finished_must_be_the_next_step_training_open_tickets(
    forged: StepFinished, why: str
) -> None:
    state = fold(_run(5)[:-1])
    reason = refusal(state, forged)
    assert reason is not None and why in reason
    assert fold([forged], state) == state


def test_tickets_closed_may_close_only_open_tickets() -> None:
    state = fold(_run(3)[:-1])
    open_ = sorted(state.ledger.open)
    assert refusal(state, TicketsClosed(ticket_ids=["t999"], reason="x")) is not None
    assert refusal(state, TicketsClosed(ticket_ids=["bogus"], reason="x")) is not None
    mixed = TicketsClosed(ticket_ids=[ticket_id(open_[0]), "t0"], reason="x")
    assert "closed already" in (refusal(state, mixed) or "")
    assert fold([mixed], state).ledger == state.ledger
    # The trainer's own write, and a copy of it, fold.
    real = TicketsClosed(ticket_ids=[ticket_id(open_[0])], reason="dead-lettered")
    after = fold([real], state)
    assert open_[0] not in after.ledger.open
    assert refusal(after, real) is None and fold([real], after) == after
    assert ledger_refusal(state.ledger, real) is None


def test_checkpoint_saved_must_be_of_the_step_being_finished_and_named_for_it() -> None:
    state = fold(_run(5)[:-1])
    assert refusal(state, _saved(6)) is None
    for forged in (_saved(5), _saved(7), _saved(10**6),
                   CheckpointSaved(step=6, path="ckpt/step-000002.pt", param_version=6),
                   CheckpointSaved(step=6, path="/etc/passwd", param_version=6)):
        assert refusal(state, forged) is not None, forged
        assert fold([forged], state) == state


def test_a_forged_checkpoint_of_the_step_in_progress_leaves_a_fallback() -> None:
    """A CheckpointSaved of the step being finished cannot be told from the trainer's by the
    fold; its file can be checked at resume: the newest checkpoint that exists is loaded,
    the steps after it re-applied (they are kept in the state)."""
    log = _run(24, save_freq=10)[:-2]  # up to StepFinished(23)
    log += [CheckpointSaved(step=24, path="/gone/step-000024.pt", param_version=24),
            _finished(24)]
    state, refused = _fold(log)
    assert refused == []
    assert state.checkpoints()[:2] == [(24, "/gone/step-000024.pt"),
                                       (20, "ckpt/step-000020.pt")]
    present = {"ckpt/step-000020.pt", "ckpt/step-000010.pt"}

    def fault(path: str) -> str | None:
        return None if path in present else f"{path} named in the log is missing"

    step, path, skipped = pick_checkpoint(state, fault)
    assert (step, path) == (20, "ckpt/step-000020.pt")
    assert skipped == ["/gone/step-000024.pt named in the log is missing"]
    assert [r.step for r in state.steps_after_checkpoint(step)] == [21, 22, 23, 24]
    with pytest.raises(ResumeFailed, match=r"/gone/step-000024\.pt named in the log is missing"):
        pick_checkpoint(state, lambda p: f"{p} named in the log is missing")
    assert pick_checkpoint(fold(_run(3)), lambda p: "gone") == (0, None, [])


# --------------------------------------------------------------------------- other readers


def test_readers_believe_a_run_finished_only_when_it_says_the_last_step() -> None:
    assert run_finished_refusal(RunFinished(run_id="r", steps=24), 24) is None
    assert run_finished_refusal(RunFinished(run_id="r", steps=10**9), 24) is not None
    assert run_finished_refusal(RunFinished(run_id="r", steps=0), 0) is not None
    # A validation-only run (trainer.val_only) finishes with the steps it started from.
    only = RunFinished(run_id="r", steps=0, validation_only=True)
    assert run_finished_refusal(only, 0) is None
    assert run_finished_refusal(only, 3) is not None


def test_the_trainer_folds_a_validation_only_end_and_a_forks_start() -> None:
    started = RunStarted(run_id="r", config={})
    only = RunFinished(run_id="r", steps=0, validation_only=True)
    state, refused = _fold([started, only])
    assert state.finished and state.last_step == 0 and not refused
    state, refused = _fold([started, RunFinished(run_id="r", steps=0)])
    assert not state.finished and refused
    forked = RunForked(run_id="f", parent="r", step=2, parent_position="1-0",
                       checkpoint="ckpt/step-000002.pt")
    trained = _run(2)[:-1]  # without its RunFinished
    state, _ = _fold([*trained, forked])
    assert (state.last_step, state.forked_at) == (2, 2)
    state, refused = _fold([*trained, forked, RunFinished(run_id="f", steps=2,
                                                          validation_only=True)])
    assert state.finished and not refused
    status = RunStatus()
    for msg in [*_run(24)[:-1], RunFinished(run_id="r", steps=10**9)]:
        status.fold(msg)
    assert status.finished_steps is None and len(status.ignored) == 1
    status.fold(RunFinished(run_id="r", steps=24))
    assert status.finished_steps == 24


# --------------------------------------------------------------------------- rollouter weights


def _pub(version: int) -> WeightsPublished:
    return WeightsPublished(version=version, ref=BlobRef(store="redis", key=f"w{version}",
                                                         size=1, sha256="0"))


class _Weights:
    """HeldWeights with blobs in a dict; records warnings, loads and the loop's complaints."""

    def __init__(self, blobs: dict[str, Any]) -> None:
        self.blobs = blobs
        self.warnings: list[WarningRaised] = []
        self.loaded: list[Any] = []
        self.held = HeldWeights("rollouter0", fetch=self.fetch, load=self.load,
                                warn=self.warn, reread=self.reread)

    async def fetch(self, msg: WeightsPublished) -> Any:
        if msg.ref.key not in self.blobs:
            raise BlobNotFound(f"blob {msg.ref.key} not found")
        return self.blobs[msg.ref.key]

    async def load(self, state: Any, version: int) -> None:
        self.loaded.append(state)

    async def warn(self, w: WarningRaised) -> None:
        self.warnings.append(w)

    async def reread(self) -> None:
        pass


async def _loop_complaints(body: Any) -> list[str]:
    loop = asyncio.get_running_loop()
    complaints: list[str] = []
    loop.set_exception_handler(lambda _, ctx: complaints.append(ctx["message"]))
    try:
        await body()
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    return complaints


@pytest.mark.asyncio
async def test_a_publication_whose_blob_is_missing_is_told_and_skipped() -> None:
    w = _Weights({"w0": "state0"})

    async def body() -> None:
        w.held.saw(_pub(0))
        await w.held.swap()
        w.held.saw(_pub(1))  # forged: no blob
        await w.held.swap()

    assert await _loop_complaints(body) == []
    assert w.held.version == 0 and w.loaded == ["state0"]
    assert [x.code for x in w.warnings] == ["weights_unloadable"]
    assert "v1" in w.warnings[0].message and "w1" in w.warnings[0].message


@pytest.mark.asyncio
async def test_a_superseded_fetch_that_found_no_blob_is_told_not_left_unretrieved() -> None:
    w = _Weights({"w0": "state0", "w2": "state2"})

    async def body() -> None:
        w.held.saw(_pub(0))
        await w.held.swap()
        w.held.saw(_pub(1))  # forged: no blob
        w.held.stage()
        await asyncio.sleep(0)  # its fetch fails at once
        await asyncio.sleep(0)
        w.held.saw(_pub(2))
        w.held.stage()  # supersedes the failed fetch
        await w.held.swap()

    assert await _loop_complaints(body) == []
    assert w.held.version == 2
    assert [("v1" in x.message) for x in w.warnings] == [True]


@pytest.mark.asyncio
async def test_a_blob_the_trainer_deleted_after_newer_publications_is_passed_silently() -> None:
    blobs = {f"w{v}": f"state{v}" for v in range(1, BLOBS_KEPT + 1)}
    w = _Weights(blobs)
    for v in range(BLOBS_KEPT + 1):
        w.held.saw(_pub(v))
    w.held.staging = (w.held.published[0], asyncio.create_task(w.fetch(w.held.published[0])))
    await w.held.swap()
    assert w.warnings == [] and w.held.version == BLOBS_KEPT


class _SlowWeights(_Weights):
    """w1's fetch takes ``delay_s`` (None: never ends); reread brings w2 into the log."""

    def __init__(self, blobs: dict[str, Any], delay_s: float | None, stranded: bool) -> None:
        super().__init__(blobs)
        self.delay_s = delay_s
        self.rereads = 0
        self.held.stranded = lambda msg: stranded and msg.ref.key == "w1"

    async def fetch(self, msg: WeightsPublished) -> Any:
        if msg.ref.key == "w1":
            await asyncio.sleep(3600 if self.delay_s is None else self.delay_s)
        return await super().fetch(msg)

    async def reread(self) -> None:
        self.rereads += 1
        if self.rereads == 1:
            self.held.saw(_pub(2))


@pytest.mark.asyncio
async def test_a_stranded_fetch_gives_way_to_a_newer_publication(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broadcast publication no round brings (the trainer sends only its newest): the
    rollouter reads the log while it waits and loads the newer one instead."""
    monkeypatch.setattr("rollouter.weights.RESTAGE_S", 0.05)
    w = _SlowWeights({"w1": "state1", "w2": "state2"}, delay_s=None, stranded=True)
    w.held.saw(_pub(1))
    await asyncio.wait_for(w.held.swap(), 10)
    assert w.held.version == 2 and w.loaded == ["state2"] and not w.warnings


@pytest.mark.asyncio
async def test_a_slow_fetch_that_will_complete_is_loaded_though_a_newer_one_appears(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Giving up every slow fetch for the next publication could load nothing at all when
    fetches are slower than publications: one that is coming is waited for."""
    monkeypatch.setattr("rollouter.weights.RESTAGE_S", 0.05)
    w = _SlowWeights({"w1": "state1", "w2": "state2"}, delay_s=0.3, stranded=False)
    w.held.saw(_pub(1))
    await asyncio.wait_for(w.held.swap(), 10)
    assert w.held.version == 1 and w.loaded == ["state1"] and w.rereads == 0


def test_a_restarted_trainer_takes_the_run_counts_from_the_logs_last_step() -> None:
    """verl's fully_async/count/* count over the run: the state keeps the last step's, and
    a step without them (written before they existed) leaves them as they were."""
    from trainer.metrics import AsyncCounts

    log = _run(3)
    counted = msgspec.structs.replace(log[3], metrics={
        "fully_async/count/stale_samples_processed": 3.0, "critic/score/mean": 0.5})
    state, refused = _fold([*log[:3], counted, *log[4:]])
    assert refused == [] and state.last_step == 3
    assert state.counts == {"fully_async/count/stale_samples_processed": 3.0}
    counts = AsyncCounts(state.counts)
    assert counts.step([], version=4)["fully_async/count/stale_samples_processed"] == 3.0
