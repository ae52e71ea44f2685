"""verl's defaults for a verl line (runconfig/verl_defaults.yaml), ``rlbus config --verl-diff``,
and every row of the verl table resolving to what it says.

``QUICKSTART`` is verl's quick-start command line (docs/start/quickstart.rst, the
``python3 -m verl.trainer.main_ppo`` one) with the model and data on local files the test
builds, and with ``ppo_mini_batch_size`` and ``data.max_response_length`` left out so that
verl's defaults show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from runconfig import (
    ConfigError,
    config_to_dict,
    default_dict,
    known_keys,
    load_config,
    verl,
    verl_differences,
    verl_preset,
)
from tests.procs import run_cli

RLBUS = "run.defaults=rlbus"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chat demo's model, parquet files and reward file (tasks.chatdemo)."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    pytest.importorskip("pyarrow", reason="the hf extra is not installed")
    from tasks.chatdemo import build_demo

    return build_demo(tmp_path_factory.mktemp("verl-preset"), n_train=600, n_val=4)


def quickstart(root: Path) -> list[str]:
    return [
        f"data.train_files={root / 'train.parquet'}",
        f"data.val_files={root / 'val.parquet'}",
        "data.train_batch_size=256",
        "data.max_prompt_length=512",
        f"actor_rollout_ref.model.path={root / 'model'}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.optim.lr=1e-5",
        f"critic.model.path={root / 'model'}",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "algorithm.kl_ctrl.kl_coef=0.001",
        "trainer.logger=console",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=10",
        "trainer.test_freq=10",
        "trainer.total_epochs=15",
        # Not in the quick-start line: the demo's data need its reward file (gsm8k has a
        # built-in scorer), and its small model a context for 512 + 512 tokens.
        f"custom_reward_function.path={root / 'reward.py'}",
        "+actor_rollout_ref.model.override_config.max_position_embeddings=1024",
    ]


def _load(args: list[str], **kw: Any) -> tuple[Any, list[str]]:
    notes: list[str] = []
    cfg = load_config(kw.pop("file", None), args, on_warning=lambda m: None,
                      on_note=notes.append, **kw)
    return cfg, notes


def test_the_quickstart_line_gets_verls_defaults(demo: Path) -> None:
    cfg, notes = _load(quickstart(demo))
    assert len(notes) == 2 and "verl's defaults" in notes[0]
    # The run's length, and how it was counted, said once.
    assert notes[1] == ("trainer.total_training_steps=30: (600 records // "
                        "data.train_batch_size=256) x trainer.total_epochs=15, as verl's "
                        "main_ppo counts them")
    assert "data.train_files" not in notes[0]  # a shared section: not what made it verl's
    assert cfg.async_training.require_batches == 1
    assert cfg.trainer.ppo_mini_batch_size == 256
    # main_ppo's run length and step: 600 // 256 batches (the last partial one dropped) x 15
    # epochs, train_batch_size prompts a step, on-policy (a sync after every step).
    assert cfg.trainer.total_training_steps == 2 * 15
    assert cfg.async_training.trigger_parameter_sync_step == 1
    assert cfg.async_training.staleness_threshold == 0.0
    assert cfg.trainer.lr == 1e-6
    assert cfg.trainer.entropy_coeff == 0.0
    assert cfg.trainer.clip_ratio_high == 0.2
    assert cfg.rollout.max_new_tokens == 512
    assert cfg.trainer.weight_decay == 0.01
    assert cfg.trainer.tis_cap is None and cfg.trainer.zero_adv == "keep"
    # What the line gives wins over verl's defaults.
    assert (cfg.trainer.total_epochs, cfg.trainer.save_freq, cfg.trainer.test_freq) == (15, 10, 10)
    assert cfg.trainer.val_before_train is False
    assert cfg.trainer.logger == "console"
    assert cfg.trainer.micro_batch_size == 4
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"


def test_an_rlbus_line_keeps_rlbus_defaults(tmp_path: Path) -> None:
    # Keys of sections both share do not make a line verl's.
    args = [f"data.train_files={tmp_path / 'd.parquet'}", "async_training.require_batches=2",
            "trainer.save_freq=5", "global_profiler.steps=[1]",
            "rollout.total_rollout_steps=64", "reward_model.reward_manager=dapo",
            "reward.max_failure_ratio=0.1"]  # rlbus's own key in verl's reward section
    cfg, notes = _load(args)
    assert notes == [  # no verl defaults; the steps total_rollout_steps gives, said
        "trainer.total_training_steps=4: 64 prompts (of rollout.total_rollout_steps=64) // "
        "16 a step (ppo_mini_batch_size x require_batches), as verl's fully-async trainer "
        "counts them"]
    assert cfg.reward.max_failure_ratio == 0.1
    rlbus = default_dict()
    assert cfg.trainer.ppo_mini_batch_size == rlbus["trainer"]["ppo_mini_batch_size"]
    assert cfg.trainer.lr == rlbus["trainer"]["lr"]
    assert cfg.rollout.max_new_tokens == rlbus["rollout"]["max_new_tokens"]
    assert cfg.trainer.default_local_dir is None


def test_run_defaults_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verl_line = ["actor_rollout_ref.actor.optim.lr=1e-6"]
    cfg, notes = _load([*verl_line, RLBUS])
    assert notes == [] and cfg.trainer.ppo_mini_batch_size == 8
    small = "rollout.max_new_tokens=5"  # the tiny default model's context is 32 tokens
    for args, file in ((["run.defaults=verl", small], None), ([small], "verl")):
        cfg, notes = _load(args, file=file)
        assert len(notes) == 1 and cfg.trainer.ppo_mini_batch_size == 256, (args, file)
    # A file named verl is a file.
    monkeypatch.chdir(tmp_path)
    Path("verl").write_text("trainer:\n  lr: 0.5\n")
    cfg, notes = _load([], file="verl")
    assert notes == [] and cfg.trainer.lr == 0.5


def test_verls_reward_section_still_makes_a_verl_line() -> None:
    cfg, notes = _load(["reward.num_workers=3", "reward.max_failure_ratio=1",
                        "rollout.max_new_tokens=5"])
    assert len(notes) == 1 and "reward.num_workers is verl's key" in notes[0]
    assert cfg.rollout.reward_workers == 3 and cfg.reward.max_failure_ratio == 1.0


def test_deleting_a_key_of_a_verl_line_gives_verls_default() -> None:
    cfg, _ = _load(["actor_rollout_ref.actor.optim.lr=1e-3", "~trainer.lr",
                    "rollout.max_new_tokens=5"])
    assert cfg.trainer.lr == 1e-6


def test_a_verl_yaml_file_gets_verls_defaults(tmp_path: Path) -> None:
    f = tmp_path / "verl.yaml"
    f.write_text("hydra:\n  searchpath: [pkg://verl.trainer.config]\n"
                 "defaults:\n  - ppo_trainer\n  - _self_\nrollout:\n  max_new_tokens: 5\n")
    cfg, notes = _load([], file=f)
    assert len(notes) == 1 and cfg.async_training.require_batches == 1


def test_default_local_dir_is_interpolated_from_the_final_names() -> None:
    line = ["actor_rollout_ref.rollout.n=4", "rollout.max_new_tokens=5"]
    cfg, _ = _load([*line, "trainer.project_name=P", "trainer.experiment_name=E"])
    assert cfg.trainer.default_local_dir == "checkpoints/P/E"
    cfg, _ = _load([*line, "trainer.default_local_dir=/ckpt/${trainer.experiment_name}"])
    assert cfg.trainer.default_local_dir == "/ckpt/gsm8k"
    with pytest.raises(ConfigError) as info:
        _load([*line, "trainer.experiment_name=null"])
    assert info.value.key == "trainer.default_local_dir"
    with pytest.raises(ConfigError) as info:
        _load([*line, "trainer.default_local_dir=${trainer.nope}"])
    assert info.value.key == "trainer.default_local_dir"


def test_a_resumed_run_keeps_its_recorded_config(demo: Path) -> None:
    # rlbus up reloads a run's recorded config as base=...: a verl line given again must not
    # put verl's defaults over what the run recorded.
    recorded = config_to_dict(load_config(None, ["trainer.ppo_mini_batch_size=8"]))
    cfg, notes = _load(quickstart(demo), base=recorded)
    assert not any("verl's defaults" in note for note in notes)
    assert cfg.trainer.ppo_mini_batch_size == 8
    # The line's train_batch_size still applies: 256 prompts a step, in mini-batches of 8.
    assert cfg.async_training.require_batches == 256 // 8
    assert cfg.trainer.lr == 1e-6  # what the line gives still applies


def test_the_preset_lists_only_differences_in_rlbus_keys() -> None:
    rlbus = default_dict()
    own = set(known_keys())
    docs = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    docs = docs[docs.index("### verl's defaults for a verl line"):]

    def leaves(node: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for name, value in node.items():
            if isinstance(value, dict):
                out += leaves(value, f"{prefix}{name}.")
            else:
                out.append((f"{prefix}{name}", value))
        return out

    for key, value in leaves(verl_preset()):
        assert key in own, key
        node: Any = rlbus
        for part in key.split("."):
            node = node[part]
        assert node != value, f"{key}: verl's default is rlbus's; leave it out"
        assert verl.counterpart(key) is not None, f"{key} has no verl key for --verl-diff"
        assert f"| `{key}`" in docs or f"`{key}`, `" in docs, f"docs/config.md lacks {key}"


def test_verl_diff() -> None:
    rows = {key: (mine, theirs, vkey) for key, mine, theirs, vkey
            in verl_differences(load_config(None, ["trainer.lr=0.01"]))}
    assert rows["trainer.lr"] == (0.01, 1e-6, "actor_rollout_ref.actor.optim.lr")
    assert rows["async_training.require_batches"][:2] == (4, 1)
    assert rows["rollout.max_new_tokens"] == (5, 512, "data.max_response_length")
    assert "heartbeat.timeout_s" not in rows  # rlbus's own: verl has no default for it
    cfg, _ = _load(["actor_rollout_ref.actor.ppo_mini_batch_size=64",
                    "rollout.max_new_tokens=5"])
    rows = {key: (mine, theirs) for key, mine, theirs, _ in verl_differences(cfg)}
    assert rows == {"trainer.ppo_mini_batch_size": (64, 256), "rollout.max_new_tokens": (5, 512)}


@pytest.mark.procs
def test_rlbus_config_verl_diff_prints_side_by_side() -> None:
    done = run_cli("config", "--verl-diff", "trainer.lr=0.01")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["key", "rlbus", "verl", "default", "verl", "key"]
    by_key = {line.split()[0]: line.split() for line in lines[1:]}
    assert by_key["trainer.lr"] == ["trainer.lr", "0.01", "1e-06",
                                    "actor_rollout_ref.actor.optim.lr"]
    assert by_key["trainer.ppo_mini_batch_size"][1:3] == ["8", "256"]
    done = run_cli("config", "--verl-diff", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
                   "rollout.max_new_tokens=5")
    assert done.returncode == 0, done.stderr
    assert "verl's defaults for every key this line leaves out" in done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()[1:]] == [
        "trainer.ppo_mini_batch_size", "rollout.max_new_tokens"]
    done = run_cli("config", "--config", "verl", "--show", "trainer.lr",
                   "rollout.max_new_tokens=5")
    assert done.returncode == 0 and done.stdout.strip() == "1.0e-06", done.stderr
    done = run_cli("config", "--verl-diff", "--show", "trainer.lr")
    assert done.returncode == 2 and "give one of them" in done.stderr


# --------------------------------------------------------------------------- the table

# Values for rows whose target's default would not show the mapping, or would be refused.
VALUES: dict[str, Any] = {
    "actor_rollout_ref.model.path": "/m",
    "actor_rollout_ref.actor.optim.warmup_style": "cosine",
    "actor_rollout_ref.actor.optim.lr_decay_style": "cosine",
    "actor_rollout_ref.model.override_config": {"x": 1},
    "actor_rollout_ref.rollout.dtype": "bf16",
    "actor_rollout_ref.actor.fsdp_config.model_dtype": "bf16",
    "data.max_response_length": 6,
    "rollout.total_rollout_steps": 64,
    "actor_rollout_ref.actor.profiler.enable": True,
    "actor_rollout_ref.rollout.profiler.enable": True,
    "actor_rollout_ref.actor.profiler.tool_config.torch.contents": ["cpu"],
    "actor_rollout_ref.rollout.profiler.tool_config.torch.contents": ["cpu"],
    "algorithm.rollout_correction.rollout_is": "token",
    "algorithm.rollout_correction.rollout_is_threshold": 3.5,
    "data.train_batch_size": 32,
}
EXPECT = {  # derived rows: the rlbus key and value they give
    "data.max_response_length": ("rollout.max_new_tokens", 6),
    "rollout.total_rollout_steps": ("trainer.total_training_steps", 2),
    "actor_rollout_ref.actor.profiler.enable": ("global_profiler.roles", ["trainer"]),
    "actor_rollout_ref.rollout.profiler.enable": ("global_profiler.roles", ["rollouter"]),
    "actor_rollout_ref.actor.profiler.tool_config.torch.contents": (
        "global_profiler.contents", ["cpu"]),
    "actor_rollout_ref.rollout.profiler.tool_config.torch.contents": (
        "global_profiler.contents", ["cpu"]),
    # rlbus's line keeps its tis_cap 2.0: rollout_is token takes verl's default threshold 2.0,
    # a threshold alone does nothing (as in verl, where rollout_is defaults to null).
    "algorithm.rollout_correction.rollout_is": ("trainer.tis_cap", 2.0),
    "algorithm.rollout_correction.rollout_is_threshold": ("trainer.tis_cap", 2.0),
    # The line gives async_training.require_batches: a fully-async line, where verl does
    # not use train_batch_size (test_verl_run_length: a classic line).
    "data.train_batch_size": ("async_training.require_batches", 4),
}


def _get(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree


def _example(row: verl.VerlKey, defaults: dict[str, Any]) -> tuple[str, Any]:
    key = row.key[:-2] + ".sub" if row.key.endswith(".*") else row.key
    if key in VALUES:
        return key, VALUES[key]
    if row.kind == "fixed":
        return key, row.values[0]
    if row.kind == "alias" and not row.key.endswith(".*"):
        return key, _get(defaults, row.targets[0][0])
    return key, 1


@pytest.mark.parametrize("row", verl.TABLE, ids=lambda r: r.key)
def test_every_table_row_resolves(row: verl.VerlKey, tmp_path: Path) -> None:
    defaults = default_dict()
    key, value = _example(row, defaults)
    if value == "/m":  # an HF model directory is read at config time: give one
        (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
        value = str(tmp_path)
    assert verl.lookup(key) is row
    warnings: list[str] = []
    plus = "+" if row.plus or row.key.endswith(".*") else ""
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    cfg = load_config(None, [f"{plus}{key}={text}", "trainer.ppo_mini_batch_size=8",
                             "async_training.require_batches=4", RLBUS],
                      on_warning=warnings.append)
    tree = config_to_dict(cfg)
    if row.kind == "ignored":
        assert [w.split("'")[1] for w in warnings] == [key]
        return
    assert warnings == []
    if row.kind == "alias" and row.key.endswith(".*"):
        target = row.targets[0][0]
        assert _get(tree, target) == {**_get(defaults, target), "sub": value}
    elif row.kind == "alias":
        target = row.targets[0][0]
        expected = -1 if target.endswith("top_k") and value == 0 else value
        assert _get(tree, target) == expected, target
    elif row.kind == "derived":
        target, expected = EXPECT[key]
        assert _get(tree, target) == expected


def test_dapos_overlong_buffer_in_a_file_and_on_the_line(tmp_path: Path) -> None:
    f = tmp_path / "dapo.yaml"
    f.write_text("reward_model:\n  reward_manager: dapo\n  reward_kwargs:\n"
                 "    overlong_buffer_cfg: {enable: true, len: 4, penalty_factor: 1.0}\n"
                 "    other: 1\n")
    cfg, notes = _load([], file=f)
    assert notes == []  # reward_model is rlbus's section: not a verl line
    buffer = cfg.reward_model.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor) == (True, 4, 1.0)
    assert cfg.reward_model.reward_kwargs == {"other": 1}
    cfg, _ = _load(["+reward.reward_kwargs.overlong_buffer_cfg.len=3",
                    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True", RLBUS])
    assert (cfg.reward_model.overlong_buffer.enable, cfg.reward_model.overlong_buffer.len) == (
        True, 3)


def test_verls_rollout_correction_is_honoured_as_token_weights_or_refused() -> None:
    """The _mis scripts' correction: token-level importance weights are trainer.tis_cap,
    rejection sampling trainer.rollout_rs (verl's options and bounds); what rlbus does not
    build (sequence weights, IcePop bounds, bypass mode) exits 2 naming the key, never
    warned and dropped."""
    rc = "algorithm.rollout_correction"
    short = "rollout.max_new_tokens=5"  # a verl line's 512 would not fit the tiny model
    cfg, _ = _load([f"{rc}.rollout_is=token", f"{rc}.rollout_is_threshold=3.5", short])
    assert cfg.trainer.tis_cap == 3.5
    cfg, _ = _load([f"{rc}.rollout_is=null", RLBUS, short])  # rlbus's line had 2.0
    assert cfg.trainer.tis_cap is None
    cfg, _ = _load([f"{rc}.rollout_is=token", f"{rc}.rollout_rs=seq_mean_k1",
                    f"{rc}.rollout_rs_threshold=0.99_1.001", short])  # the _mis script's
    assert (cfg.trainer.tis_cap, cfg.trainer.rollout_rs, cfg.trainer.rollout_rs_threshold) == (
        2.0, "seq_mean_k1", "0.99_1.001")
    refused = {
        f"{rc}.rollout_is=sequence": f"{rc}.rollout_is",
        f"{rc}.rollout_is_threshold=0.5_2.0": f"{rc}.rollout_is_threshold",
        f"{rc}.rollout_rs=seq_mean_k9": f"{rc}.rollout_rs",  # not one of verl's options
        f"{rc}.rollout_rs=seq_mean_k1": "trainer.rollout_rs_threshold",  # it needs bounds
        f"{rc}.bypass_mode=True": f"{rc}.bypass_mode",
        f"{rc}.rollout_is_batch_normalize=True": f"{rc}.rollout_is_batch_normalize",
        "trainer.tis_cap=4.0": f"{rc}.rollout_is",  # two values for one key
    }
    for line, key in refused.items():
        with pytest.raises(ConfigError) as err:
            _load([f"{rc}.rollout_is=token", line, short])
        assert err.value.key == key, line


@pytest.mark.parametrize("line", [
    "actor_rollout_ref.rollout.agent.agent_loop_config_path=loops.yaml",
    "actor_rollout_ref.model.lora_rank=32",
])
def test_a_key_that_changes_what_the_job_is_is_refused(line: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load([line, "rollout.max_new_tokens=5"])
    key = line.split("=")[0]
    assert err.value.key == key, err.value.key
    assert any(why in err.value.message for why in ("the job would", "not run", "needs verl"))
    off = {"loops.yaml": "null", "32": "0"}[line.split("=")[1]]
    # The value meaning "not used" is accepted, silently.
    _load([f"{key}={off}", "rollout.max_new_tokens=5"])


def test_conversations_without_what_they_need_are_refused_naming_the_key() -> None:
    """multi_turn.enable=True is honoured (docs/agents.md): refused only without a Hugging
    Face model to write tool turns with, or without tools."""
    with pytest.raises(ConfigError) as err:
        _load(["actor_rollout_ref.rollout.multi_turn.enable=True", "rollout.max_new_tokens=5"])
    assert err.value.key == "actor_rollout_ref.rollout.multi_turn.enable"
    assert "Hugging Face model" in err.value.message
