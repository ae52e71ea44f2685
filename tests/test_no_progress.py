"""Progress, not pulses; one bad answer, one reissue (pure parts, no Redis).

- :func:`trainer.dispatch.no_progress` takes the tickets of a live rollouter whose progress
  counter stood still for longer than the bound, and only those;
- :func:`trainer.health.observe_progress` notes when each rollouter's counter last changed;
- the rollouter's counter moves at every decode step (:func:`policy.decode_steps`), so a
  long generation is progress;
- the intake asks for one reissue per invalid attempt of a ticket, however many of that
  group's responses are refused and however they are split into reads.
"""

from __future__ import annotations

import msgspec
import numpy as np

from bus import Delivery
from policy import build_policy, decode_steps
from runschema.messages import Array, Heartbeat, Sample, decode, encode
from trainer.dispatch import no_progress
from trainer.health import Progress, observe_progress
from trainer.intake import Complete, Intake, Refuse
from trainer.ledger import Ledger, OpenTicket, ticket_id

# ---------------------------------------------------------------------------- no progress


def test_a_rollouter_holding_tickets_without_progress_past_the_bound_loses_them() -> None:
    held = {"rollouter-0": [3, 1], "rollouter-1": [2], "rollouter-2": [4]}
    since = {"rollouter-0": 100.0, "rollouter-1": 139.0, "rollouter-2": 120.0}
    # rollouter-0: still for 50 s > 30 s; rollouter-1: moved 11 s ago; rollouter-2: still
    # for exactly the bound, not past it.
    assert no_progress(held, since, now=150.0, bound=30.0) == {"rollouter-0": [1, 3]}
    assert no_progress(held, since, now=130.0, bound=30.0) == {}


def test_a_rollouter_without_tickets_or_without_a_counter_is_never_judged() -> None:
    since = {"rollouter-0": 0.0}
    assert no_progress({"rollouter-0": []}, since, now=1e6, bound=1.0) == {}
    # An older rollouter reports no counter: its liveness alone keeps its tickets.
    assert no_progress({"rollouter-5": [7]}, since, now=1e6, bound=1.0) == {}


def _hb(rank: int, progress: int | None, pid: int = 10, role: str = "rollouter") -> Heartbeat:
    return Heartbeat(role=role, rank=rank, pid=pid, progress=progress)


def test_the_trainer_notes_when_each_counter_last_changed() -> None:
    seen = observe_progress({}, [_hb(0, 5), _hb(1, None), _hb(0, 9, role="trainer")], now=1.0)
    assert seen == {"rollouter-0": Progress(10, 5, 1.0)}
    # Unchanged: the first time it was seen stays; moved: seen since now.
    seen = observe_progress(seen, [_hb(0, 5), _hb(2, 0)], now=4.0)
    assert seen == {"rollouter-0": Progress(10, 5, 1.0), "rollouter-2": Progress(10, 0, 4.0)}
    seen = observe_progress(seen, [_hb(0, 6), _hb(2, 0)], now=7.0)
    assert seen == {"rollouter-0": Progress(10, 6, 7.0), "rollouter-2": Progress(10, 0, 4.0)}
    # A restarted process (new pid) starts over, even with an equal counter; a rollouter
    # no longer alive is forgotten.
    seen = observe_progress(seen, [_hb(2, 0, pid=11)], now=9.0)
    assert seen == {"rollouter-2": Progress(11, 0, 9.0)}


def test_a_heartbeat_without_a_counter_still_decodes() -> None:
    old = msgspec.msgpack.encode({"type": "Heartbeat", "v": 1, "role": "rollouter", "rank": 0,
                                  "pid": 1})
    hb = decode(old)
    assert isinstance(hb, Heartbeat) and hb.progress is None
    beat = _hb(0, 42)
    assert decode(encode(beat)) == beat


def test_every_decode_step_is_progress() -> None:
    """A long single generation moves the counter at every token, not at its end."""
    policy = build_policy({"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 64}, "cpu")
    before = decode_steps()
    out = policy.generate([[1, 2, 3], [4, 5]], max_new_tokens=12, eos_id=[], seed=0)
    # The prefill, then one forward pass per token after the first.
    assert decode_steps() - before == max(len(t) for t in out.tokens) == 12


# ---------------------------------------------------------------------------- one reissue

N = 4


def _sample(ticket: int, index: int, *, attempt: int = 0, reward: float = 1.0) -> Sample:
    return Sample(
        sample_id=f"{ticket_id(ticket)}/{index}", ticket_id=ticket_id(ticket), prompt_id="p",
        index=index, n=N, prompt_tokens=Array.of(np.asarray([1, 2], dtype=np.int32)),
        response_tokens=Array.of(np.asarray([3, 4], dtype=np.int32)),
        logprobs=Array.of(np.asarray([-0.1, -0.2], dtype=np.float32)), reward=reward,
        min_version=1, max_version=1, attempt=attempt)


def _judge(intake: Intake, ledger: Ledger, *msgs: Sample) -> list:
    deliveries = [Delivery(f"1-{k}", m, 1, "samples") for k, m in enumerate(msgs)]
    return intake.judge(deliveries, ledger, 1, vocab_size=16, max_len=32)


def _ledger(attempt: int) -> Ledger:
    return Ledger(issued=10, open={3: OpenTicket(3, N, attempt, 1)})


def _reissues(verdicts: list) -> list[int]:
    return [v.reissue for v in verdicts if isinstance(v, Refuse) and v.reissue is not None]


def test_one_invalid_group_asks_for_one_reissue_in_one_read() -> None:
    intake = Intake(max_new_tokens=5, max_staleness=1)
    verdicts = _judge(intake, _ledger(0), *(_sample(3, i, reward=float("nan"))
                                             for i in range(N)))
    assert [type(v) for v in verdicts] == [Refuse] * N
    assert _reissues(verdicts) == [3]


def test_one_invalid_group_asks_for_one_reissue_across_reads() -> None:
    intake = Intake(max_new_tokens=5, max_staleness=1)
    bad = [_sample(3, i, reward=float("nan")) for i in range(N)]
    # Before the reissue is written (the ledger still at attempt 0), then after it.
    assert _reissues(_judge(intake, _ledger(0), bad[0])) == [3]
    assert _reissues(_judge(intake, _ledger(0), bad[1])) == []
    assert _reissues(_judge(intake, _ledger(1), bad[2], bad[3])) == []
    # The new attempt answers validly and wins.
    (won,) = _judge(intake, _ledger(1), *(_sample(3, i, attempt=1) for i in range(N)))
    assert isinstance(won, Complete) and won.group.attempt == 1


def test_an_invalid_answer_of_an_older_attempt_changes_nothing_of_the_newer() -> None:
    intake = Intake(max_new_tokens=5, max_staleness=1)
    assert _judge(intake, _ledger(1), _sample(3, 0, attempt=1)) == []  # partial, waiting
    (refused,) = _judge(intake, _ledger(1), _sample(3, 1, attempt=0, reward=float("nan")))
    assert isinstance(refused, Refuse) and refused.reissue is None
    verdicts = _judge(intake, _ledger(1), *(_sample(3, i, attempt=1) for i in range(1, N)))
    assert [type(v) for v in verdicts] == [Complete]


def test_a_new_attempt_that_is_invalid_too_asks_once_more() -> None:
    intake = Intake(max_new_tokens=5, max_staleness=1)
    assert _reissues(_judge(intake, _ledger(0), _sample(3, 0, reward=float("nan")))) == [3]
    bad = [_sample(3, i, attempt=1, reward=float("nan")) for i in range(N)]
    assert _reissues(_judge(intake, _ledger(1), *bad)) == [3]
