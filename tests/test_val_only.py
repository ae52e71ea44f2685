"""verl's ``trainer.val_only`` without processes: the config's rules (exit 2 naming the key),
the validation it asks, the facts it writes and how every reader takes them. The real-process
run is tests/test_e2e_val_only.py."""

from __future__ import annotations

import asyncio

import pytest

from rollouter.events import EventPoller
from runconfig import ConfigError, load_config
from runschema.facts import validation_only_refusal
from runschema.messages import RunFinished, RunStarted
from trainer.validation import validation_due

VAL = "data.val_files=/data/val.parquet"


def _load(*args: str):
    return load_config(None, list(args), on_warning=lambda m: None)


def test_val_only_is_a_key_of_its_own_and_needs_something_to_validate() -> None:
    assert _load(VAL, "trainer.val_only=True").trainer.val_only is True
    for args, key, words in [
        (("trainer.val_only=True",), "trainer.val_only", "data.val_files"),
        ((VAL, "trainer.val_only=True", "trainer.val_before_train=False"),
         "trainer.val_only", "validates nothing"),
        ((VAL, "trainer.val_only=True", "global_profiler.tool=torch",
          "global_profiler.steps=[1]"), "global_profiler.steps", "no step to profile"),
    ]:
        with pytest.raises(ConfigError) as err:
            _load(*args)
        assert err.value.key == key and words in err.value.message, err.value


def test_the_one_version_published_is_validated_whatever_the_schedule() -> None:
    cfg = _load(VAL, "trainer.val_only=True", "trainer.test_freq=5")
    assert validation_due(0, cfg, last=False)
    assert validation_due(7, cfg, last=False)  # a fork's: not a multiple of test_freq
    train = _load(VAL, "trainer.test_freq=5")
    assert not validation_due(7, train, last=False)


def test_a_run_with_its_own_steps_is_refused_a_fresh_one_or_a_fork_is_not() -> None:
    assert validation_only_refusal("r", 0, None) is None
    assert validation_only_refusal("f", 20, 20) is None
    why = validation_only_refusal("r", 12, None)
    assert why is not None and "rlbus fork --run r --at 12 --new-run NEW" in why
    assert validation_only_refusal("f", 21, 20) is not None  # the fork trained on


def _finished(steps: int, validation_only: bool = True) -> RunFinished:
    return RunFinished(run_id="r", steps=steps, validation_only=validation_only)


def _finished(steps: int, validation_only: bool = True) -> RunFinished:
    return RunFinished(run_id="r", steps=steps, validation_only=validation_only)


class _Log:
    def __init__(self, entries: list) -> None:
        self.entries, self.caught_up, self.position = entries, True, "0-0"

    async def poll(self, block_ms: int | None = None) -> list:
        out, self.entries = self.entries, []
        return out


async def _noop() -> None:
    return None


def _poller(entries: list, complaints: list[str]) -> EventPoller:
    return EventPoller(_Log(entries), saw_weights=lambda w: None, total_steps=300,
                       profiler=lambda: None, commands=_noop,
                       publish=lambda *e: _noop(), complain=complaints.append,
                       stream="trainer")


def test_a_rollouter_ends_with_a_validation_only_run_not_with_a_short_training_one() -> None:
    complaints: list[str] = []
    only = _poller([("1-0", RunStarted(run_id="r", config={})), ("2-0", _finished(0))],
                   complaints)
    asyncio.run(only.poll())
    assert only.finished and not complaints
    # A RunFinished(0) that does not say it only validated is not the trainer's.
    forged = _poller([("1-0", RunStarted(run_id="r", config={})),
                      ("2-0", _finished(0, validation_only=False))], complaints)
    asyncio.run(forged.poll())
    assert not forged.finished and complaints
