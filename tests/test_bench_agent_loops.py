"""bench/agent_loops.py's quick mode, in this process (no Redis, no processes): both loops
serve every conversation of the same workload, the result has the bench's structure, and
on long-tailed tools the continuous loop keeps its engine busier than the batch-per-turn
loop.

That last check compares two shares measured in the same run, not a time against a bound,
and the workload (seed 0) gives it a wide margin: the batch loop's engine waits, twice per
batch of 8, for the slowest of 8 lognormal tool calls (median 100 ms, p99 20x) against
~0.2 s of simulated generation per turn, so it is busy ~25%; the continuous loop's engine
idles only when every conversation it holds is in a tool call (~80% busy). Load on the
machine only adds Python time between engine calls, which lowers the continuous share
first (it makes ~10x more engine calls); closing a 3x gap would take tens of ms of extra
time per call. (The draws are seeded: a seed whose few slowest calls dominate the run,
e.g. 3, narrows the gap to 2x; the test keeps seed 0.)"""

from __future__ import annotations

import math

from bench.agent_loops import LOOPS, params, report, run_bench


def test_quick_mode_serves_both_loops_and_continuous_keeps_the_engine_busier() -> None:
    p = params(quick=True)
    result = run_bench(p)

    assert set(result) == {"params", "tool_ms", "loops", "ratio", "aim"}
    assert set(result["loops"]) == set(LOOPS)
    keys = {"samples_per_s", "engine_busy", "waiting_on_tools", "trainer_idle", "wall_s",
            "engine_calls", "steps_per_call", "tokens_per_step", "engine_busy_steady",
            "waiting_on_tools_steady", "steady_s"}
    for figures in result["loops"].values():
        assert set(figures) == keys
        assert all(math.isfinite(v) and v >= 0 for v in figures.values())
        for share in ("engine_busy", "waiting_on_tools", "trainer_idle", "engine_busy_steady",
                      "waiting_on_tools_steady"):
            assert 0.0 <= figures[share] <= 1.0
        assert 0 < figures["steady_s"] <= figures["wall_s"]
    assert set(result["ratio"]) == keys
    assert set(result["aim"]) == {"busy", "waiting", "holds"}
    # The workload is long-tailed as drawn (seeded): p99 well above the median.
    assert result["tool_ms"]["p99"] > 5 * result["tool_ms"]["p50"]
    # The batch loop makes one generate call per turn of each batch; the continuous loop
    # many short slices.
    batches = math.ceil(p["conversations"] / p["capacity"])
    assert result["loops"]["batch"]["engine_calls"] == batches * p["turns"]
    assert result["loops"]["continuous"]["engine_calls"] > batches * p["turns"]

    busy = {k: result["loops"][k]["engine_busy"] for k in LOOPS}
    assert busy["continuous"] > busy["batch"], busy
    assert "cont/batch" in report(result)
