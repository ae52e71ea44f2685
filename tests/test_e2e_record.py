"""The run's record on a real run (issue 39): a 40-step run with a checkpoint every 10 and
retention on keeps every sample it trained readable with pyarrow after the run (counts equal
its StepFinished events), verl's ``rollout_data_dir`` JSONL beside it; ``rlbus replay``
rebuilds step 27's model bit for bit from the checkpoint of step 20 and the record, and
``--check`` walks steps 0-12 from the config's model matching each publication; ``rlbus
inspect --samples`` prints a step's samples; a corrupt record segment is one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.procs import FAST, run_cli

pytestmark = pytest.mark.e2e

RUN = "rec"
STEPS = 40


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("record") / "out"
    up = run_cli("up", f"run.output_dir={out}", f"run.id={RUN}", *FAST,
                 f"trainer.total_training_steps={STEPS}", "trainer.save_freq=10",
                 f"trainer.rollout_data_dir={out / 'dump'}", "trainer.logger=[]",
                 "trainer.ppo_epochs=2",  # a second epoch: the clip ratios act
                 timeout_s=280)
    assert up.returncode == 0, up.stdout + up.stderr
    return out


def _events(out: Path, run: str = RUN) -> list[dict]:
    res = run_cli("inspect", "--run", run, "--json", f"run.output_dir={out}")
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


def test_every_trained_sample_is_in_the_record_after_the_run(finished_run: Path) -> None:
    out = finished_run
    segments = sorted((out / RUN / "record").glob("samples-*.parquet"))
    assert len(segments) >= 4  # written as retention trimmed (every 10 steps), then the end
    table = pa.concat_tables([pq.read_table(p) for p in segments])
    rows = table.select(["step", "verdict", "entry_id", "sample_id", "score"]).to_pylist()
    assert len({r["entry_id"] for r in rows}) == len(rows)  # nothing recorded twice
    finished = {e["step"]: e for e in _events(out) if e["type"] == "StepFinished"}
    assert sorted(finished) == list(range(1, STEPS + 1))
    trained = [r for r in rows if r["verdict"] == "trained"]
    for step, event in finished.items():
        mine = [r for r in trained if r["step"] == step]
        assert [r["entry_id"] for r in mine] == sorted(event["entry_ids"],
                                                       key=lambda i: tuple(map(int, i.split("-"))))
        assert sorted(r["sample_id"] for r in mine) == sorted(event["sample_ids"])
        assert sum(r["score"] for r in mine) / len(mine) == pytest.approx(
            event["metrics"]["critic/score/mean"], abs=1e-9)
    # verl's dump of the same samples: {step}.jsonl with its keys
    dumped = [json.loads(line) for line in (out / "dump" / "7.jsonl").read_text().splitlines()]
    assert len(dumped) == len(finished[7]["sample_ids"])
    assert set(dumped[0]) == {"input", "output", "gts", "score", "step"}
    assert {d["step"] for d in dumped} == {7}


def test_replay_of_step_27_matches_the_published_weights_bit_for_bit(finished_run: Path) -> None:
    res = run_cli("replay", "--run", RUN, "--step", "27", f"run.output_dir={finished_run}",
                  timeout_s=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "replaying steps 21-27 from the checkpoint of step 20" in res.stdout
    assert "step 27: the model" in res.stdout and "matches weights version 27" in res.stdout


def test_check_walks_every_step_from_the_config_model(finished_run: Path) -> None:
    res = run_cli("replay", "--run", RUN, "--step", "12", "--check",
                  f"run.output_dir={finished_run}", timeout_s=240)
    assert res.returncode == 0, res.stdout + res.stderr
    matched = [line for line in res.stdout.splitlines() if "matches weights version" in line]
    assert len(matched) == 13  # versions 0-12: one per step with trigger 1
    assert "DIFFERS" not in res.stdout


def test_retrain_reproduces_the_run_with_its_settings_and_differs_with_others(
        finished_run: Path) -> None:
    same = run_cli("retrain", "--from", RUN, "--steps", "11-20",
                   f"run.output_dir={finished_run}", timeout_s=240)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "step 20: the model" in same.stdout and "matches weights version 20" in same.stdout
    other = run_cli("retrain", "--from", RUN, "--steps", "11-20", "--name", "tight",
                    "actor_rollout_ref.actor.clip_ratio_high=0.001",
                    f"run.output_dir={finished_run}", timeout_s=240)
    assert other.returncode == 0, other.stdout + other.stderr
    assert "DIFFERS from weights version 20" in other.stdout
    out = finished_run / RUN / "retrain" / "tight"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["changed"] == {"trainer.clip_ratio_high": [0.28, 0.001]}
    assert sorted(map(int, summary["metrics"])) == list(range(11, 21))
    assert any(v["actor/pg_clipfrac"] > 0 for v in summary["metrics"].values())
    for side in (RUN, "tight"):  # one TensorBoard folder, the two curves side by side
        assert list((out / "tensorboard" / side).glob("events.out.tfevents.*"))
    refused = run_cli("retrain", "--from", RUN, "rollout.n=8",
                      f"run.output_dir={finished_run}")
    assert refused.returncode == 2
    assert refused.stderr.strip().startswith("rlbus retrain: error: rollout.n: ")


def test_a_fork_at_step_20_goes_on_from_the_parents_state_with_its_overrides(
        finished_run: Path) -> None:
    fork = run_cli("fork", "--run", RUN, "--at", "20", "--new-run", "rec-lr",
                   "actor_rollout_ref.actor.optim.lr=5e-4", f"run.output_dir={finished_run}",
                   timeout_s=240)
    assert fork.returncode == 0, fork.stdout + fork.stderr
    assert "matches weights version 20" in fork.stdout
    again = run_cli("fork", "--run", RUN, "--at", "20", "--new-run", "rec-lr",
                    f"run.output_dir={finished_run}")
    assert again.returncode == 2 and "already has a log" in again.stderr
    up = run_cli("up", f"run.output_dir={finished_run}", "run.id=rec-lr", timeout_s=280)
    assert up.returncode == 0, up.stdout + up.stderr
    res = run_cli("inspect", "--run", "rec-lr", f"run.output_dir={finished_run}")
    assert res.returncode == 0, res.stderr
    assert ("lineage: forked from run rec after step 20 (actor_rollout_ref.actor.optim.lr=5e-4)"
            in res.stdout)
    mine = _events(finished_run, "rec-lr")
    parents = {e["step"]: e for e in _events(finished_run) if e["type"] == "StepFinished"}
    steps = {e["step"]: e for e in mine if e["type"] == "StepFinished"}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step in range(1, 21):  # the parent's, as they were
        assert steps[step]["metrics"] == parents[step]["metrics"]
    resumed = [e for e in mine if e["type"] == "TrainerResumed"]
    assert [(r["step"], r["weights_match"], r["replayed_steps"]) for r in resumed] == [
        (20, True, 0)]
    started = [e for e in mine if e["type"] == "RunStarted"]
    assert started[-1]["config"]["trainer"]["lr"] == 5e-4
    # the fork's own steps replay from its checkpoint; the parent's are the parent's
    own = run_cli("replay", "--run", "rec-lr", "--step", "24",
                  f"run.output_dir={finished_run}", timeout_s=240)
    assert own.returncode == 0 and "matches weights version 24" in own.stdout, own.stderr
    theirs = run_cli("replay", "--run", "rec-lr", "--step", "15",
                     f"run.output_dir={finished_run}")
    assert theirs.returncode == 2 and "step 15 is run rec's" in theirs.stderr


def test_inspect_prints_a_steps_samples(finished_run: Path) -> None:
    res = run_cli("inspect", "--run", RUN, "--samples", "--step", "5", "--json",
                  f"run.output_dir={finished_run}")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 16  # FAST: 4 prompts x 4 responses
    assert {r["step"] for r in rows} == {5} and all(r["prompt"] for r in rows)


def test_a_step_past_the_run_and_a_corrupt_segment_are_one_line(finished_run: Path) -> None:
    res = run_cli("replay", "--run", RUN, "--step", "41", f"run.output_dir={finished_run}")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "rlbus replay: error: step 41 is not a finished step of this run (its log finished "
        "steps 1-40)"]
    segment = sorted((finished_run / RUN / "record").glob("samples-*.parquet"))[0]
    data = bytearray(segment.read_bytes())
    segment.write_bytes(bytes(data[: len(data) // 2]))  # a truncated copy
    res = run_cli("replay", "--run", RUN, "--step", "3", "--check",
                  f"run.output_dir={finished_run}", timeout_s=240)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(segment) in lines[0], res.stderr


def test_a_two_rank_run_replays_within_the_stated_tolerance(tmp_path: Path) -> None:
    """Two trainer ranks sum in another order than the one-rank replay: not bit for bit, so
    the replay is held to its stated tolerance against the run's checkpoints (dcp shards,
    loaded into one rank) and says so."""
    out = tmp_path / "out"
    up = run_cli("up", f"run.output_dir={out}", "run.id=ranks", *FAST,
                 "trainer.total_training_steps=6", "trainer.save_freq=3",
                 "trainer.n_gpus_per_node=2", "trainer.logger=[]", timeout_s=280)
    assert up.returncode == 0, up.stdout + up.stderr
    res = run_cli("replay", "--run", "ranks", "--step", "6", "--check",
                  f"run.output_dir={out}", timeout_s=240)
    assert res.returncode == 0, res.stdout + res.stderr
    within = [line for line in res.stdout.splitlines() if "is within tolerance" in line]
    assert [line.split(":")[0] for line in within] == ["step 3", "step 6"], res.stdout
    assert "not bit for bit" in res.stdout and "rank(s)" in res.stdout
