"""Validation of a verl user's job end to end: the chat demo's tiny Qwen2, parquet data and
reward file; trainer and rollouter as real processes. Needs the verl data loader
(tasks.verl_data) and the reward pool (rollouter.scoring): skipped without them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runschema.messages import RunFinished, ValidationFinished
from tests.procs import FAST, Procs, events_of, run_cli

pytest.importorskip("tasks.verl_data", reason="the verl data loader is not in this tree")
pytest.importorskip("rollouter.scoring", reason="the reward pool is not in this tree")


@pytest.fixture
def procs(tmp_path: Path):
    p = Procs(tmp_path / "logs")
    yield p
    p.kill_all()


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_verl_job_reports_validation_per_data_source(
    redis_url: str, bus: Bus, run_id: str, tmp_path: Path, procs: Procs
) -> None:
    from tasks.chatdemo import DATA_SOURCE, build_demo

    demo = build_demo(tmp_path / "demo", n_train=64, n_val=8)
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}", *FAST,
            "run.retention=all", "model.kind=hf", f"model.path={demo / 'model'}",
            f"data.train_files={demo / 'train.parquet'}",
            f"data.val_files={demo / 'val.parquet'}",
            f"custom_reward_function.path={demo / 'reward.py'}",
            "rollout.max_new_tokens=8", "trainer.total_training_steps=4",
            "trainer.test_freq=2", "rollout.val_kwargs.n=2", "trainer.log_val_generations=2",
            f"trainer.validation_data_dir={tmp_path / 'val-dump'}"]
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    assert procs.wait("trainer", 300) == 0, procs.log("trainer")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")

    events = await events_of(bus, RunKeys(run_id).events)
    answers = [e for e in events if isinstance(e, ValidationFinished)]
    assert [a.request_id for a in answers] == ["val-v0", "val-v2", "val-v4"]
    # Before training: the initial model, on the built-in engine too (it said v1 before).
    assert (answers[0].version, answers[0].step) == (0, 0)
    for a in answers:
        assert not a.error, a.error
        assert 0.0 <= a.metrics[f"val-core/{DATA_SOURCE}/reward/mean@2"] <= 1.0
        assert f"val-core/{DATA_SOURCE}/reward/best@2/mean" in a.metrics
        assert f"val-aux/{DATA_SOURCE}/exact/mean@2" in a.metrics, "the reward's extra key"
        assert len(a.generations) == 2 and "Reverse" in a.generations[0][0]
    finished = [i for i, e in enumerate(events) if isinstance(e, RunFinished)]
    assert finished and finished[-1] > events.index(answers[-1])
    # Every answer kept (issue 39): the run's record and verl's validation_data_dir JSONL.
    import pyarrow.parquet as pq

    kept = sorted((tmp_path / run_id / "record").glob("validation-*.parquet"))
    assert [p.name for p in kept] == [f"validation-{a.step:06d}-v{a.version}-r{a.rank}.parquet"
                                      for a in answers]
    table = pq.read_table(kept[-1]).to_pylist()
    assert len(table) == 8 * 2  # every record, val_kwargs.n answers each
    assert {r["data_source"] for r in table} == {DATA_SOURCE}
    dumped = (tmp_path / "val-dump" / f"{answers[-1].step}.jsonl").read_text().splitlines()
    assert [json.loads(line)["output"] for line in dumped] == [r["response"] for r in table]
    # The plot draws the validation curve beside the training metrics.
    png = tmp_path / "run.png"
    res = run_cli("inspect", "--run", run_id, "--plot", str(png), f"redis.url={redis_url}")
    assert res.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", res.stderr
