"""verl's step unit (runconfig.stepunit): ``global_profiler.steps``, ``save_freq`` and
``test_freq`` count parameter versions, ``trigger_parameter_sync_step`` updates each.

Pure functions and the profiler service's plan, checked for T = 1, 2, 4 (hypothesis), and the
config check that refuses a step past the run's last version.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profiler_service import schedule
from profiler_service.schedule import plan_sessions
from profiler_service.state import fold
from runconfig import ConfigError, load_config
from runconfig.schema import ProfilerConfig
from runconfig.stepunit import (
    is_save_update,
    is_test_update,
    is_version_boundary,
    last_version,
    version_of_update,
    version_step_updates,
    version_steps_to_updates,
)
from runschema.messages import RunStarted

TRIGGERS = (1, 2, 4)
steps_lists = st.lists(st.integers(1, 40), max_size=12)


@settings(max_examples=300, deadline=None)
@given(steps_lists, st.sampled_from(TRIGGERS), st.booleans())
def test_ranges_cover_exactly_the_updates_of_the_chosen_versions(
    steps: list[int], trigger: int, continuous: bool
) -> None:
    ranges = version_steps_to_updates(steps, trigger, continuous)
    covered = [u for first, last in ranges for u in range(first, last + 1)]
    assert len(covered) == len(set(covered))  # no update twice
    assert set(covered) == {u for u in range(1, 41 * trigger)
                            if version_of_update(u, trigger) in set(steps)}
    assert ranges == sorted(ranges)
    for first, last in ranges:  # every range is whole versions
        assert first % trigger == 1 % trigger and last % trigger == 0
    if not continuous:
        assert len(ranges) == len(set(steps))


@settings(max_examples=200, deadline=None)
@given(steps_lists, st.booleans())
def test_trigger_1_is_the_identity(steps: list[int], continuous: bool) -> None:
    ranges = version_steps_to_updates(steps, 1, continuous)
    expected = schedule.step_runs(steps) if continuous else [(s, s) for s in sorted(set(steps))]
    assert ranges == expected


def test_issue_example_t4() -> None:
    # steps=[1,2,5], T=4: verl profiles updates 1-4, 5-8 and 17-20.
    assert version_steps_to_updates([1, 2, 5], 4, False) == [(1, 4), (5, 8), (17, 20)]
    assert version_steps_to_updates([1, 2, 5], 4, True) == [(1, 8), (17, 20)]
    assert version_step_updates(3, 2) == (5, 6)


@pytest.mark.parametrize("trigger", TRIGGERS)
def test_version_boundaries_and_last_version(trigger: int) -> None:
    updates = range(1, 7 * trigger)
    assert [u for u in updates if is_version_boundary(u, trigger)] == [
        k * trigger for k in range(1, 7)]
    assert [version_of_update(u, trigger) for u in range(1, 2 * trigger + 1)] == (
        [1] * trigger + [2] * trigger)
    # verl's total_train_steps: whole versions only (a last partial version is no step).
    assert last_version(6 * trigger, trigger) == 6
    assert last_version(6 * trigger + trigger - 1, trigger) == 6
    assert last_version(trigger - 1, trigger) == 0


@pytest.mark.parametrize("trigger", TRIGGERS)
@pytest.mark.parametrize("save_freq", [0, 1, 3])
def test_save_freq_counts_versions(trigger: int, save_freq: int) -> None:
    total = 10 * trigger + 1  # ends with a partial version when trigger > 1
    saved = [u for u in range(1, total + 1) if is_save_update(u, save_freq, trigger, total)]
    periodic = [k * save_freq * trigger for k in range(1, 11) if save_freq
                and k * save_freq <= 10]
    assert saved == sorted({*periodic, total})


def test_save_freq_t1_is_the_old_rule() -> None:
    for save_freq in (0, 1, 2, 5):
        for total in (1, 7, 10):
            for u in range(1, total + 1):
                old = (save_freq > 0 and u % save_freq == 0) or u == total
                assert is_save_update(u, save_freq, 1, total) == old


@pytest.mark.parametrize("trigger", TRIGGERS)
def test_test_freq_counts_versions(trigger: int) -> None:
    tested = [u for u in range(1, 12 * trigger + 1) if is_test_update(u, 5, trigger)]
    assert tested == [5 * trigger, 10 * trigger]
    assert not any(is_test_update(u, -1, trigger) for u in range(1, 20))
    assert not any(is_test_update(u, 0, trigger) for u in range(1, 20))


def test_bad_trigger_and_step_raise() -> None:
    with pytest.raises(ValueError):
        version_steps_to_updates([1], 0, False)
    with pytest.raises(ValueError):
        version_step_updates(0, 2)


def _cfg(steps: list[int], continuous: bool) -> ProfilerConfig:
    return ProfilerConfig(tool="torch", steps=steps, profile_continuous_steps=continuous)


@pytest.mark.parametrize("trigger", TRIGGERS)
@pytest.mark.parametrize("continuous", [False, True])
def test_plan_commands_carry_updates_and_ids_name_verl_steps(
    trigger: int, continuous: bool
) -> None:
    total = 6 * trigger - 1  # 5 whole versions (and a partial sixth when trigger > 1)
    plan = plan_sessions(_cfg([1, 2, 5, 6], continuous), 1, total, trigger=trigger)
    spans = [(1, 2), (5, 5)] if continuous else [(1, 1), (2, 2), (5, 5)]
    assert [s.session_id for s in plan] == [f"s{a}-{b}" for a, b in spans]  # 6 never happens
    assert [(s.first_step, s.last_step) for s in plan] == [
        ((a - 1) * trigger + 1, b * trigger) for a, b in spans]


@pytest.mark.parametrize("trigger", TRIGGERS)
def test_the_service_plans_with_the_runs_trigger(trigger: int) -> None:
    started = RunStarted(run_id="r1", ts=1.0, config={
        "trainer": {"total_training_steps": 8 * trigger},
        "async_training": {"trigger_parameter_sync_step": trigger},
        "rollout": {"replicas": 1}})
    state = fold([started])
    assert state.trigger == trigger
    out = schedule.decide(_cfg([2, 3], True), state)
    sent = [m for m in out if m.__class__.__name__ == "StartProfile"]
    assert [(s.session_id, s.first_step, s.last_step) for s in sent] == [
        ("s2-3", trigger + 1, 3 * trigger)]


@pytest.mark.parametrize(("trigger", "total", "steps", "ok"), [
    (4, 20, "[1,2,5]", True),     # updates 1-4, 5-8, 17-20
    (4, 19, "[1,2,5]", False),    # version 5 ends at update 20
    (2, 7, "[3]", True),          # 3 whole versions; update 7 is a partial fourth
    (2, 7, "[4]", False),
    (1, 5, "[5]", True),
])
def test_steps_past_the_last_version_exit_2_naming_the_key(
    trigger: int, total: int, steps: str, ok: bool
) -> None:
    args = ["global_profiler.tool=torch", f"trainer.total_training_steps={total}",
            f"async_training.trigger_parameter_sync_step={trigger}",
            f"global_profiler.steps={steps}"]
    if ok:
        load_config(None, args)
        return
    with pytest.raises(ConfigError) as info:
        load_config(None, args)
    assert info.value.key == "global_profiler.steps"
    assert "parameter versions" in str(info.value)
    assert f"trigger_parameter_sync_step={trigger}" in str(info.value)
