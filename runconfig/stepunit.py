"""verl's step unit for the keys it counts in parameter versions (pure, dependency-free).

verl's fully-async trainer counts ``global_profiler.steps``, ``trainer.save_freq`` and
``trainer.test_freq`` in *parameter versions*: one version per weight sync, that is one per
``async_training.trigger_parameter_sync_step`` (``T``) trainer updates. Its profiler checks
``current_param_version + 1 in steps`` before each update, so verl's step ``s`` is the ``T``
updates ``(s-1)*T+1 .. s*T`` (those that train the weights of version ``s-1`` into version
``s``); it checkpoints when ``current_param_version % save_freq == 0`` after a sync and
validates when ``current_param_version % test_freq == 0``. Its run length in versions is
``total_train_steps = total_updates // T``: updates after the last full sync (a last partial
version) bump no version and are no step of their own.

rlbus's trainer counts updates (``StepStarted``/``StepFinished.step``,
``trainer.total_training_steps``). The functions here translate, so that these keys mean what
they mean in verl; with ``T = 1`` every function is the identity of the update count.

This module is shared by the trainer (checkpoints, validation), the profiler service (which
updates a profiled step covers) and the config check (the run's last version).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "is_save_update",
    "is_test_update",
    "is_version_boundary",
    "last_version",
    "version_of_update",
    "version_step_updates",
    "version_steps_to_updates",
]


def _check_trigger(trigger: int) -> None:
    if trigger < 1:
        raise ValueError(f"trigger_parameter_sync_step must be >= 1, got {trigger}")


def last_version(total_updates: int, trigger: int) -> int:
    """The run's last verl step: the number of full weight syncs in ``total_updates``
    updates (verl's ``total_train_steps``; a last partial version is no step)."""
    _check_trigger(trigger)
    return max(0, total_updates) // trigger


def version_step_updates(step: int, trigger: int) -> tuple[int, int]:
    """The updates ``(first, last)`` (1-based, inclusive) of verl step ``step``."""
    _check_trigger(trigger)
    if step < 1:
        raise ValueError(f"steps are 1-based, got {step}")
    return (step - 1) * trigger + 1, step * trigger


def version_steps_to_updates(
    steps: Iterable[int], trigger: int, continuous: bool
) -> list[tuple[int, int]]:
    """The update ranges ``(first, last)`` that profile verl steps ``steps``, ascending.

    ``continuous`` (``profile_continuous_steps``): each maximal run of consecutive verl steps
    is one range; otherwise one range per step. Their union is exactly the updates of the
    chosen steps; with ``trigger`` 1 a range is the steps themselves.
    """
    _check_trigger(trigger)
    ordered = sorted({s for s in steps if s >= 1})
    runs: list[tuple[int, int]] = []
    for step in ordered:
        if continuous and runs and step == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return [(version_step_updates(a, trigger)[0], version_step_updates(b, trigger)[1])
            for a, b in runs]


def is_version_boundary(update: int, trigger: int) -> bool:
    """Whether update ``update`` ends a parameter version (the trainer syncs after it)."""
    _check_trigger(trigger)
    return update >= 1 and update % trigger == 0


def version_of_update(update: int, trigger: int) -> int:
    """The verl step update ``update`` belongs to (``ceil(update / trigger)``; 0 for 0)."""
    _check_trigger(trigger)
    return -(-max(0, update) // trigger)


def _every_versions(update: int, freq: int, trigger: int) -> bool:
    return freq > 0 and is_version_boundary(update, trigger) and (update // trigger) % freq == 0


def is_save_update(update: int, save_freq: int, trigger: int, total_updates: int) -> bool:
    """Whether the trainer checkpoints after update ``update``: every ``save_freq`` versions
    (``save_freq * trigger`` updates; 0 = no periodic checkpoint), and always after the
    run's last update (verl saves at the end too, ``force=True``)."""
    return _every_versions(update, save_freq, trigger) or update == total_updates


def is_test_update(update: int, test_freq: int, trigger: int) -> bool:
    """Whether validation follows update ``update``: every ``test_freq`` versions
    (``test_freq * trigger`` updates; ``<= 0`` = never periodically), as verl validates when
    ``current_param_version % test_freq == 0`` after a sync. The run's end and
    ``val_before_train`` are the caller's to add."""
    return _every_versions(update, test_freq, trigger)
