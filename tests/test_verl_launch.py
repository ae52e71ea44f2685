"""A verl fully-async launch line, run by rlbus unchanged apart from its model and data paths.

``VERL_LAUNCH`` is written from the keys of verl's fully-async launch scripts
(``verl/experimental/fully_async_policy/shell/*.sh``: the DAPO recipe's keys, sized down to a
few steps of a tiny model). In verl it follows
``python -m verl.experimental.fully_async_policy.fully_async_main``; here it follows
``rlbus up``. The first test checks what each key becomes (with verl's defaults for the keys
the line leaves out: it is a verl line); the second runs it end to end (embedded Redis,
trainer and rollouter as processes) on the chat demo's tiny Qwen2 (``tasks.chatdemo``), a
JSONL file in verl's record layout and the demo's reward file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rollouter.engine import vllm_installed
from runconfig import config_to_dict, load_config
from tests.procs import run_cli

MODEL_PATH = "{MODEL_PATH}"
TRAIN_FILE = "{TRAIN_FILE}"
REWARD_FILE = "{REWARD_FILE}"

VERL_LAUNCH = f"""
    data.train_files={TRAIN_FILE}
    data.val_files={TRAIN_FILE}
    data.prompt_key=prompt
    data.truncation=left
    data.max_prompt_length=16
    data.max_response_length=5
    data.train_batch_size=0
    data.gen_batch_size=1
    data.return_raw_chat=True
    actor_rollout_ref.rollout.n=4
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    algorithm.kl_ctrl.kl_coef=0.0
    actor_rollout_ref.actor.fsdp_config.strategy=fsdp2
    critic.strategy=fsdp2
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.clip_ratio_c=10.0
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.hybrid_engine=False
    +actor_rollout_ref.model.override_config.max_position_embeddings=32
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=64
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=64
    actor_rollout_ref.model.path={MODEL_PATH}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.lr_warmup_steps=10
    actor_rollout_ref.actor.optim.weight_decay=0.1
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.grad_clip=1.0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.80
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.enable_chunked_prefill=True
    actor_rollout_ref.rollout.max_num_batched_tokens=64
    actor_rollout_ref.rollout.max_num_seqs=64
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7
    actor_rollout_ref.rollout.val_kwargs.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.val_kwargs.n=1
    actor_rollout_ref.rollout.calculate_log_probs=True
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=1
    actor_rollout_ref.actor.fsdp_config.fsdp_size=1
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.mode=async
    reward.reward_manager.name=dapo
    reward.custom_reward_function.path={REWARD_FILE}
    reward.custom_reward_function.name=compute_score
    +reward.reward_kwargs.overlong_buffer_cfg.enable=False
    +reward.reward_kwargs.max_resp_len=5
    trainer.logger=['console']
    trainer.project_name=DAPO
    trainer.experiment_name=DAPO-tiny-fully-async
    trainer.val_before_train=True
    trainer.save_freq=-1
    trainer.default_local_dir=checkpoints/DAPO
    trainer.resume_mode=auto
    trainer.nnodes=1
    trainer.n_gpus_per_node=1
    rollout.nnodes=1
    rollout.n_gpus_per_node=1
    rollout.total_rollout_steps=12
    trainer.total_epochs=10
    trainer.test_freq=10
    async_training.staleness_threshold=0.1
    async_training.trigger_parameter_sync_step=1
    async_training.require_batches=1
    async_training.partial_rollout=True
    global_profiler.steps=null
""".split()

MAPPED = {
    "data.max_prompt_length": 16,
    "data.truncation": "left",
    "trainer.ppo_mini_batch_size": 4,
    "trainer.lr": 1e-6,
    "trainer.clip_ratio_low": 0.2,
    "trainer.clip_ratio_high": 0.28,
    "trainer.entropy_coeff": 0.0,
    "trainer.grad_clip": 1.0,
    "trainer.total_training_steps": 3,  # 12 prompts // (4 per mini-batch x 1 mini-batch)
    "trainer.save_freq": 0,  # -1: no periodic checkpoint
    "rollout.n": 4,
    "rollout.temperature": 1.0,
    "rollout.max_new_tokens": 5,
    "rollout.top_p": 1.0,
    "rollout.top_k": -1,
    "rollout.val_kwargs.temperature": 1.0,
    "rollout.val_kwargs.top_p": 0.7,
    "rollout.val_kwargs.do_sample": True,
    "model.kind": "hf",
    "model.override_config": {"max_position_embeddings": 32},
    "trainer.weight_decay": 0.1,
    "trainer.lr_warmup_steps": 10,
    "trainer.use_kl_loss": False,
    "trainer.kl_loss_coef": 0.0,
    "trainer.use_dynamic_bsz": True,
    "trainer.max_token_len": 64,
    "trainer.total_epochs": 10,
    "trainer.test_freq": 10,
    "trainer.val_before_train": True,
    "trainer.default_local_dir": "checkpoints/DAPO",
    "trainer.resume_mode": "auto",
    "trainer.project_name": "DAPO",
    "reward_model.reward_manager": "dapo",
    "reward_model.overlong_buffer.enable": False,
    "custom_reward_function.name": "compute_score",
    "async_training.staleness_threshold": 0.1,
    "async_training.require_batches": 1,
    "async_training.partial_rollout": True,
    "global_profiler.steps": [],
    # verl's defaults for what the line leaves out (runconfig/verl_defaults.yaml)
    "trainer.tis_cap": None,
    "trainer.zero_adv": "keep",
    "rollout.reward_workers": 8,
    "model.enable_gradient_checkpointing": True,
    # The trainer's ranks: one, as the line says (trainer.nnodes=1, n_gpus_per_node=1).
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 1,
}
IGNORED = ("rollout.nnodes", "actor_rollout_ref.rollout.mode",
           "actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "reward.reward_kwargs.max_resp_len")


def _line(files: dict[str, Path]) -> list[str]:
    out = []
    for arg in VERL_LAUNCH:
        for name, path in files.items():
            arg = arg.replace(name, str(path))
        out.append(arg)
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The chat demo's model and reward file, six verl-format records as JSONL."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from tasks.chatdemo import REWARD_FILE as REWARD_TEXT
    from tasks.chatdemo import build_model, records

    root = tmp_path_factory.mktemp("verl-launch")
    build_model(root / "model", n_digits=3)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(6, "train", 0, n_digits=3)))
    (root / "reward.py").write_text(REWARD_TEXT)
    return {MODEL_PATH: root / "model", TRAIN_FILE: data, REWARD_FILE: root / "reward.py"}


def _get(tree: dict, key: str) -> object:
    for part in key.split("."):
        tree = tree[part]
    return tree


def test_the_verl_launch_line_means_what_it_says(demo: dict[str, Path]) -> None:
    warnings: list[str] = []
    notes: list[str] = []
    cfg = load_config(None, _line(demo), on_warning=warnings.append, on_note=notes.append)
    assert len(notes) == 2 and "verl's defaults" in notes[0]
    assert notes[1].startswith(f"trainer.total_training_steps={cfg.trainer.total_training_steps}:")
    tree = config_to_dict(cfg)
    for key, value in MAPPED.items():
        assert _get(tree, key) == value, key
    assert cfg.model.path == str(demo[MODEL_PATH])
    assert cfg.data.train_files == str(demo[TRAIN_FILE])
    assert cfg.custom_reward_function.path == str(demo[REWARD_FILE])
    named = [w.split("'")[1] for w in warnings]
    assert len(named) == len(set(named))  # one warning per key
    assert set(IGNORED) <= set(named)
    mapped_spellings = {a.split("=")[0].lstrip("+") for a in VERL_LAUNCH} - set(named)
    assert "actor_rollout_ref.actor.optim.lr" in mapped_spellings  # not warned about


@pytest.mark.e2e
def test_the_verl_launch_line_runs_with_rlbus_up(tmp_path: Path, demo: dict[str, Path]) -> None:
    done = run_cli("up", *_line(demo), cwd=tmp_path, timeout_s=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for key in IGNORED:
        assert done.stderr.count(f"'{key}'") == 1, key
    if not vllm_installed():  # rollout.name=vllm: the job runs on the built-in engine
        assert "vLLM is not installed in this venv" in done.stdout + done.stderr
    (run_dir,) = [p.parent for p in (tmp_path / "outputs").glob("*/config.yaml")]
    tree = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key, value in MAPPED.items():
        assert _get(tree, key) == value, key
    # save_freq=-1: no periodic checkpoint, only the last step's (the trained model).
    # CHANGED EXPECTATION (issue 18): with trainer.default_local_dir honoured the checkpoints
    # are under checkpoints/DAPO (relative to the working directory, as verl's); before it,
    # under RUN/checkpoints. Either place, one step saved: the last.
    found = [*(run_dir / "checkpoints").glob("*"), *(tmp_path / "checkpoints").rglob("*")]
    saved = sorted({int(n) for p in found for n in re.findall(r"step[-_](\d+)", p.name)})
    assert saved == [3], sorted(p.name for p in found)
    shown = run_cli("inspect", "--run", run_dir.name, "--json", cwd=tmp_path, timeout_s=120)
    assert shown.returncode == 0, shown.stderr
    steps = [e["step"] for e in map(json.loads, shown.stdout.splitlines())
             if e.get("type") == "StepFinished"]
    assert steps == [1, 2, 3]
