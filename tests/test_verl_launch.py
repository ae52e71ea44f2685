"""A verl fully-async launch line, run by rlbus unchanged apart from its model and data paths.

``VERL_LAUNCH`` is written from the keys of verl's fully-async launch scripts
(``verl/experimental/fully_async_policy/shell/*.sh``: the DAPO recipe's keys, sized down to a
few steps of a tiny model). In verl it follows
``python -m verl.experimental.fully_async_policy.fully_async_main``; here it follows
``rlbus up``. The first test checks what each key becomes; the second runs it end to end
(embedded Redis, trainer and rollouter as processes) on a tiny local GPT-2 and a JSONL file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from runconfig import config_to_dict, load_config
from tests.procs import run_cli

MODEL_PATH = "{MODEL_PATH}"
TRAIN_FILE = "{TRAIN_FILE}"

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
    "model.kind": "hf",
    "task.kind": "jsonl",
    "async_training.staleness_threshold": 0.1,
    "async_training.partial_rollout": True,
    "global_profiler.steps": [],
}
IGNORED = ("trainer.nnodes", "trainer.test_freq", "trainer.val_before_train",
           "actor_rollout_ref.rollout.gpu_memory_utilization",
           "actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.name",
           "actor_rollout_ref.model.override_config.max_position_embeddings",
           "reward.reward_kwargs.max_resp_len")


def _line(model: Path, data: Path) -> list[str]:
    return [a.replace(MODEL_PATH, str(model)).replace(TRAIN_FILE, str(data)) for a in VERL_LAUNCH]


def _get(tree: dict, key: str) -> object:
    for part in key.split("."):
        tree = tree[part]
    return tree


def test_the_verl_launch_line_means_what_it_says(tmp_path: Path) -> None:
    warnings: list[str] = []
    cfg = load_config(None, _line(tmp_path / "model", tmp_path / "train.jsonl"),
                      on_warning=warnings.append)
    tree = config_to_dict(cfg)
    for key, value in MAPPED.items():
        assert _get(tree, key) == value, key
    assert cfg.model.path == str(tmp_path / "model")
    assert cfg.task.path == str(tmp_path / "train.jsonl")
    named = [w.split("'")[1] for w in warnings]
    assert len(named) == len(set(named))  # one warning per key
    assert set(IGNORED) <= set(named)
    mapped_spellings = {a.split("=")[0].lstrip("+") for a in VERL_LAUNCH} - set(named)
    assert "actor_rollout_ref.actor.optim.lr" in mapped_spellings  # not warned about


def _tiny_model_and_data(tmp_path: Path) -> tuple[Path, Path]:
    from tests.test_e2e_hf import _save_tiny_model

    model = tmp_path / "model"
    _save_tiny_model(model)
    data = tmp_path / "train.jsonl"
    rows = [f"{a}{b}{c}>" for a, b, c in ("123", "456", "789", "321", "654", "987")]
    data.write_text("".join(json.dumps({"prompt": p, "answer": p[:-1][::-1]}) + "\n"
                            for p in rows))
    return model, data


@pytest.mark.e2e
def test_the_verl_launch_line_runs_with_rlbus_up(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    model, data = _tiny_model_and_data(tmp_path)
    done = run_cli("up", *_line(model, data), cwd=tmp_path, timeout_s=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for key in IGNORED:
        assert done.stderr.count(f"'{key}'") == 1, key
    (run_dir,) = [p.parent for p in (tmp_path / "outputs").glob("*/config.yaml")]
    tree = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key, value in MAPPED.items():
        assert _get(tree, key) == value, key
    # save_freq=-1: no periodic checkpoint, only the last step's (the trained model).
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt"))
    assert len(checkpoints) == 1 and "3" in checkpoints[0], checkpoints
    shown = run_cli("inspect", "--run", run_dir.name, "--json", cwd=tmp_path, timeout_s=120)
    assert shown.returncode == 0, shown.stderr
    steps = [e["step"] for e in map(json.loads, shown.stdout.splitlines())
             if e.get("type") == "StepFinished"]
    assert steps == [1, 2, 3]
