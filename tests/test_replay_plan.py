"""The pure parts of replay and retrain (issue 39): the fold of a run's log into what a replay
needs, the plan of a replay, the grouping of a step's samples, the step ranges and the keys a
retrain may change. No Redis, no model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlbus.retrain import _refusal, changed_keys, parse_steps
from runconfig import load_config
from runschema.messages import (
    Array,
    BlobRef,
    CheckpointSaved,
    FileDigest,
    RunForked,
    RunStarted,
    Sample,
    StepFinished,
    WeightsPublished,
)
from trainer.replay import NotReplayable, RunLog, group_in_order, plan
from trainer.state import StepRecord


def _finished(step: int, ids: list[str] | None = None) -> StepFinished:
    ids = ids or [f"{step}-{i}" for i in range(2)]
    return StepFinished(step=step, sample_ids=[f"s{i}" for i in ids], metrics={"m": step},
                        duration_s=0.5, param_version=step - 1, entry_ids=ids)


def _log(steps: int, checkpoints: tuple[int, ...] = ()) -> RunLog:
    log = RunLog()
    log.take(RunStarted(run_id="r", config={"trainer": {"lr": 1.0}}))
    for step in range(1, steps + 1):
        log.take(_finished(step))
        log.take(WeightsPublished(version=step, ref=BlobRef("dir", f"v{step}", 1, f"h{step}"),
                                  step=step))
        if step in checkpoints:
            log.take(CheckpointSaved(step=step, path=f"/c/step-{step:06d}.pt",
                                     param_version=step,
                                     files={"x": FileDigest(size=1, sha256="a")}))
    return log


def test_the_fold_keeps_steps_checkpoints_publications_and_configs() -> None:
    log = _log(5, checkpoints=(2, 4))
    log.take(RunStarted(run_id="r", config={"trainer": {"lr": 2.0}}, resumed=True))
    log.take(WeightsPublished(version=3, ref=BlobRef("dir", "m", 1, "ref"), step=3,
                              manifest=BlobRef("transport", "m", 1, "manifest-digest")))
    assert log.last_step == 5 and sorted(log.steps) == [1, 2, 3, 4, 5]
    assert log.steps[3] == StepRecord(3, ("s3-0", "s3-1"), 2, ("3-0", "3-1"))
    assert log.metrics[4] == {"m": 4} and log.durations[4] == 0.5
    assert sorted(log.checkpoints) == [2, 4]
    assert log.published[3].sha256 == "manifest-digest" and log.published[3].manifest
    assert log.published[2].sha256 == "h2" and not log.published[2].manifest
    # the config in effect for the step after `step`: the newest RunStarted written by then
    assert log.config_at(0) == {"trainer": {"lr": 1.0}}
    assert log.config_at(5) == {"trainer": {"lr": 2.0}}


@given(st.integers(1, 30), st.sets(st.integers(1, 30), max_size=6), st.data())
def test_a_plan_starts_from_checkpoints_at_or_before_the_target_newest_first(
        steps: int, ckpts: set[int], data: st.DataObject) -> None:
    log = _log(steps, checkpoints=tuple(c for c in ckpts if c <= steps))
    target = data.draw(st.integers(1, steps))
    p = plan(log, target)
    starts = [s for s, _ in p.starts]
    assert starts[-1] == 0 and p.starts[-1][1] is None  # the config's model last
    assert starts[:-1] == sorted((c for c in ckpts if c <= target), reverse=True)
    assert p.steps_after(starts[0]) == list(range(starts[0] + 1, target + 1))


@pytest.mark.parametrize("target", [0, 6])
def test_a_step_the_run_did_not_finish_is_not_replayable(target: int) -> None:
    with pytest.raises(NotReplayable, match=f"step {target} is not a finished step"):
        plan(_log(5), target)


def test_a_fork_replays_from_its_own_checkpoints_and_names_its_parent() -> None:
    log = _log(30, checkpoints=(25,))
    log.take(RunForked(run_id="f", parent="p", step=20, parent_position="1-0",
                       checkpoint="/f/step-000020.pt"))
    assert [s for s, _ in plan(log, 27).starts] == [25, 20]  # never the config's model
    assert [s for s, _ in plan(log, 22).starts] == [20]
    with pytest.raises(NotReplayable, match=r"step 12 is run p's: .* after step 20"):
        plan(log, 12)


def _sample(ticket: str, index: int) -> Sample:
    return Sample(sample_id=f"{ticket}/{index}", ticket_id=ticket, prompt_id="p", index=index,
                  n=2, prompt_tokens=Array.of([1]), response_tokens=Array.of([2]),
                  logprobs=Array.of([0.0], "float32"), reward=0.0, min_version=0,
                  max_version=0)


def test_groups_follow_the_order_the_step_finished_named_them() -> None:
    by_entry = {"1-0": _sample("t2", 1), "1-1": _sample("t1", 0), "1-2": _sample("t2", 0),
                "1-3": _sample("t1", 1)}
    rec = StepRecord(1, (), 0, ("1-0", "1-1", "1-2", "1-3"))
    groups = group_in_order(rec, by_entry)
    assert [[s.sample_id for s in g] for g in groups] == [["t2/0", "t2/1"], ["t1/0", "t1/1"]]


def test_step_ranges() -> None:
    assert parse_steps(None, 40) == (1, 40)
    assert parse_steps("11-20", 40) == (11, 20)
    assert parse_steps("30", 40) == (30, 40)
    for bad in ("0-3", "5-41", "9-3", "x", "3-"):
        with pytest.raises(ValueError, match="--steps"):
            parse_steps(bad, 40)


def test_a_retrain_may_change_the_trainers_settings_only() -> None:
    base = load_config(None, [])
    loss = load_config(None, ["actor_rollout_ref.actor.clip_ratio_high=0.4",
                              "run.output_dir=/elsewhere"], base=_tree(base))
    changed = changed_keys(base, loss)
    assert changed["trainer.clip_ratio_high"] == (0.28, 0.4)
    assert _refusal(changed) is None  # run.* is where the data lives, not the job
    for key in ("rollout.n=3", "model.seed=12345", "trainer.n_gpus_per_node=2"):
        other = load_config(None, [key], base=_tree(base))
        why = _refusal(changed_keys(base, other))
        assert why is not None and why.startswith(key.split("=")[0] + ": ")


def _tree(cfg: object) -> dict:
    from runconfig import config_to_dict

    return config_to_dict(cfg)  # type: ignore[arg-type]


def test_state_difference_holds_a_replay_to_the_stated_tolerance() -> None:
    import torch

    from trainer.replay import TOLERANCE, state_difference

    start = {"w": torch.tensor([1.0, -2.0, 0.0]), "b": torch.tensor([0.5])}
    run = {"w": torch.tensor([1.3, -2.4, 0.0]), "b": torch.tensor([0.5])}  # moved by 0.5
    same = state_difference({k: v.clone() for k, v in run.items()}, run, start)
    assert same.distance == 0.0 and same.update == pytest.approx(0.5) and same.within
    near = {"w": run["w"] + torch.tensor([0.0, 0.0, 0.5 * TOLERANCE * 0.5]), "b": run["b"]}
    d = state_difference(near, run, start)
    assert d.within and d.ratio == pytest.approx(TOLERANCE / 2, rel=1e-5)
    far = {"w": run["w"] + torch.tensor([0.0, 0.0, 2 * TOLERANCE * 0.5]), "b": run["b"]}
    assert not state_difference(far, run, start).within
    assert not state_difference(start, run, start).within  # a step not applied: 100%
    assert not state_difference({"w": run["w"]}, run, start).within  # a weight missing
    assert not state_difference({"w": run["w"][:2], "b": run["b"]}, run, start).within


def test_a_fork_writes_into_no_folder_of_its_parents() -> None:
    from rlbus.fork import _own_folders
    from runconfig import config_to_dict

    parent = load_config(None, ["trainer.default_local_dir=/runs/ckpt",
                                "trainer.rollout_data_dir=/runs/dump"])
    inherited = load_config(None, ["run.id=child"], base=config_to_dict(parent))
    fork, lines = _own_folders(parent, inherited)
    assert fork.trainer.default_local_dir is None and fork.trainer.rollout_data_dir is None
    assert [line.split("=")[0] for line in lines] == ["trainer.default_local_dir",
                                                      "trainer.rollout_data_dir"]
    given = load_config(None, ["trainer.default_local_dir=/runs/child"],
                        base=config_to_dict(parent))
    fork, lines = _own_folders(parent, given)
    assert fork.trainer.default_local_dir == "/runs/child"
    assert [line.split("=")[0] for line in lines] == ["trainer.rollout_data_dir"]
