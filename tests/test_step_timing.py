"""A trainer step's wall time, lap by lap (trainer.timing): the laps add up to the window,
the windows tile the clock, an unknown name is refused. No Redis, no process."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer.timing import PHASES, step_clock


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_laps_go_to_their_names_and_add_up_to_the_window() -> None:
    clock = _Clock()
    laps = step_clock(clock)
    clock.now += 0.5
    laps.lap("wait_samples")
    clock.now += 0.25
    laps.lap("read_samples")
    clock.now += 0.125
    laps.lap("wait_samples")
    clock.now += 0.0625
    window = laps.close("write_step")
    assert window["timing_s/wait_samples"] == 0.625
    assert window["timing_s/read_samples"] == 0.25
    assert window["timing_s/write_step"] == 0.0625
    assert window["timing_s/judge"] == 0.0
    assert window["timing_s/step"] == 0.9375
    # The next window starts where this one closed, with every lap at zero.
    clock.now += 1.0
    assert laps.close("judge") == {**dict.fromkeys(window, 0.0), "timing_s/judge": 1.0,
                                   "timing_s/step": 1.0}


def test_an_unknown_name_is_refused() -> None:
    with pytest.raises(KeyError):
        step_clock(_Clock()).lap("lunch")


@given(st.lists(st.lists(st.tuples(st.sampled_from(PHASES),
                                   st.floats(0, 10, allow_nan=False)), max_size=12),
                min_size=1, max_size=6))
def test_windows_tile_the_clock(steps: list[list[tuple[str, float]]]) -> None:
    """Whatever the laps, each window's laps sum to its timing_s/step, and the windows sum
    to the time the clock moved."""
    clock = _Clock()
    start = clock.now
    laps = step_clock(clock)
    total = 0.0
    for step in steps:
        for name, seconds in step:
            clock.now += seconds
            laps.lap(name)
        window = laps.close("judge")
        assert sum(v for k, v in window.items() if k != "timing_s/step") == \
            pytest.approx(window["timing_s/step"], abs=1e-9)
        total += window["timing_s/step"]
    assert total == pytest.approx(clock.now - start, abs=1e-9)
