"""A verl line's run length, in verl's units (issue 37 item 2).

verl's fully-async trainer generates ``min(rollout.total_rollout_steps, records x
total_epochs)`` prompts (its dataloader takes one prompt at a time); its classic trainer runs
``(records // train_batch_size) x total_epochs`` steps of ``train_batch_size`` prompts (the
last partial batch of each epoch dropped) unless ``trainer.total_training_steps`` is given.
rlbus counts updates: the same prompts, divided by ``ppo_mini_batch_size x
require_batches``. The records are counted from the files (tasks.verl_data.count_records):
only their number matters here, so the files hold bare rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from runconfig import Config, ConfigError, load_config
from tasks.verl_data import count_records


def _data(tmp_path: Path, n: int, name: str = "train.parquet") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / name
    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(n)]}), path)
    return path


NOTES: list[str] = []


def _load(*line: str) -> Config:
    NOTES.clear()
    return load_config(None, [*line, "rollout.max_new_tokens=5"], on_warning=lambda m: None,
                       on_note=NOTES.append)


FULLY_ASYNC = ("async_training.staleness_threshold=0.1", "actor_rollout_ref.actor."
               "ppo_mini_batch_size=4", "async_training.require_batches=2")


def test_a_fully_async_line_is_capped_by_its_data(tmp_path: Path) -> None:
    data = _data(tmp_path, 20)
    # 2 epochs of 20 records: 40 prompts, fewer than 100; 40 // (4 x 2) = 5 updates.
    cfg = _load(f"data.train_files={data}", "trainer.total_epochs=2",
                "rollout.total_rollout_steps=100", *FULLY_ASYNC)
    assert cfg.trainer.total_training_steps == 5
    # Enough data: total_rollout_steps binds (verl's DAPO line: 512 x 100 prompts).
    cfg = _load(f"data.train_files={data}", "trainer.total_epochs=10",
                "rollout.total_rollout_steps=64", *FULLY_ASYNC)
    assert cfg.trainer.total_training_steps == 8
    # No data files: total_rollout_steps alone, as before.
    cfg = _load("rollout.total_rollout_steps=64", *FULLY_ASYNC)
    assert cfg.trainer.total_training_steps == 8
    # verl's train_batch_size is not used by a fully-async line (its scripts give 0).
    cfg = _load(f"data.train_files={data}", "data.train_batch_size=0",
                "rollout.total_rollout_steps=64", "trainer.total_epochs=10", *FULLY_ASYNC)
    assert cfg.async_training.require_batches == 2
    assert cfg.data.epoch_batch_size == 0  # verl's fully-async rollouter reads every record


def test_a_classic_line_runs_verls_steps_of_train_batch_size_prompts(tmp_path: Path) -> None:
    # The case: 15 epochs of 2 000 prompts, 8 a step: verl's 3 750 steps (not 300).
    data = _data(tmp_path, 2000)
    classic = (f"data.train_files={data}", "data.train_batch_size=8",
               "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_epochs=15")
    cfg = _load(*classic)
    assert cfg.trainer.total_training_steps == 3750
    assert NOTES[-1] == ("trainer.total_training_steps=3750: (2000 records // "
                         "data.train_batch_size=8) x trainer.total_epochs=15, as verl's "
                         "main_ppo counts them")
    asyn = cfg.async_training
    assert (asyn.require_batches, asyn.trigger_parameter_sync_step,
            asyn.staleness_threshold) == (2, 1, 0.0)
    assert cfg.data.epoch_batch_size == 8  # its epochs end with their last whole batch
    # Each epoch drops its last partial batch, as verl's dataloader (drop_last).
    cfg = _load(f"data.train_files={_data(tmp_path, 21, 'odd.parquet')}",
                *classic[1:3], "trainer.total_epochs=3")
    assert cfg.trainer.total_training_steps == (21 // 8) * 3
    # A given total_training_steps wins, as in verl; max_samples counts first.
    cfg = _load(*classic, "trainer.total_training_steps=7")
    assert cfg.trainer.total_training_steps == 7
    cfg = _load(*classic, "data.train_max_samples=80")
    assert cfg.trainer.total_training_steps == 10 * 15


def test_a_classic_batch_that_does_not_split_or_fill_a_step_exits_2(tmp_path: Path) -> None:
    data = _data(tmp_path, 5)
    with pytest.raises(ConfigError) as err:
        _load(f"data.train_files={data}", "data.train_batch_size=6",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    assert err.value.key == "data.train_batch_size" and "ppo_mini_batch_size=4" in str(err.value)
    with pytest.raises(ConfigError) as err:
        _load(f"data.train_files={data}", "data.train_batch_size=8",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_epochs=1")
    assert err.value.key == "data.train_batch_size" and "no step" in str(err.value)


def test_a_dataset_class_s_records_are_not_counted_from_the_files(tmp_path: Path) -> None:
    # verl's data.custom_cls makes the records (the files may be folders it reads): a
    # fully-async line's steps are not capped by the files; a classic line must say its steps.
    folder = tmp_path / "hf-dataset-folder"
    folder.mkdir()
    custom = (f"data.train_files={folder}", f"data.custom_cls.path={tmp_path / 'd.py'}",
              "data.custom_cls.name=D")
    cfg = _load(*custom, "rollout.total_rollout_steps=64", "trainer.total_epochs=1",
                *FULLY_ASYNC)
    assert cfg.trainer.total_training_steps == 8
    classic = ("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    with pytest.raises(ConfigError) as err:
        _load(*custom, *classic, "trainer.total_epochs=2")
    assert err.value.key == "data.custom_cls.path" and "trainer.total_training_steps" in str(
        err.value)
    assert _load(*custom, *classic, "trainer.total_epochs=2",
                 "trainer.total_training_steps=5").trainer.total_training_steps == 5


def test_records_are_counted_from_parquet_footers_and_json_lines(tmp_path: Path) -> None:
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    files = [str(_data(tmp_path, 7)), str(jsonl)]
    assert count_records(files) == 9 and count_records(files, max_samples=4) == 4
    with pytest.raises(ConfigError) as err:
        count_records([str(tmp_path / "missing.parquet")])
    assert err.value.key == "data.train_files"
