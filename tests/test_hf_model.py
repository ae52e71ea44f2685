"""The model keys on a tiny Qwen2 built here (tasks.chatdemo): dtype, override_config,
gradient checkpointing, and the config-time check of the model's context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from policy import build_policy
from runconfig import ConfigError, load_config
from trainer.grpo import Batch, build_batch

pytest.importorskip("transformers")

from tasks.chatdemo import build_model

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("qwen") / "model")


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


def _hf(model_dir: Path, **cfg: object) -> torch.nn.Module:
    training = bool(cfg.pop("training", False))
    return build_policy({"kind": "hf", "path": str(model_dir), **cfg}, "cpu", training=training)


def _batch(policy: torch.nn.Module, seed: int = 0) -> Batch:
    gen = policy.generate(PROMPTS * 2, 5, temperature=1.0, seed=seed)
    return build_batch(list(zip(PROMPTS * 2, gen.tokens, gen.logprobs, strict=True)),
                       policy.pad_id)


def test_bf16_rollout_weights_and_fp32_training_weights(model_dir: Path) -> None:
    rollout = _hf(model_dir, dtype="bf16")
    trainer = _hf(model_dir, dtype="bf16", training=True)
    full = _hf(model_dir, dtype="fp32", training=True)
    assert {p.dtype for p in rollout.parameters()} == {torch.bfloat16}
    # The trainer keeps float32 weights (the optimizer's) and computes in bf16 autocast.
    assert {p.dtype for p in trainer.parameters()} == {torch.float32}
    assert trainer.autocast == torch.bfloat16 and full.autocast is None
    b = _batch(rollout)
    m = b.response_mask.bool()
    logp, ent = trainer.logprobs_and_entropy(b.input_ids, b.attention_mask, b.response_len)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    # bf16 rollout log-probs against bf16-autocast recomputation: close, not equal.
    torch.testing.assert_close(logp[m].detach(), b.old_logprobs[m], atol=0.1, rtol=0.05)
    logp[m].sum().backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in trainer.parameters())
    # The trainer's weights load into the bf16 rollouter (cast).
    rollout.load_state(trainer.model.state_dict())


def test_override_config_is_set_before_loading(model_dir: Path) -> None:
    policy = _hf(model_dir, override_config={"max_position_embeddings": 512,
                                             "attention_dropout": 0.0})
    assert policy.model.config.max_position_embeddings == 512
    plain = _hf(model_dir)
    assert plain.model.config.max_position_embeddings == 4096  # tasks.chatdemo's qwen2
    # The same weights: the override changed the config, not what was loaded.
    for a, b in zip(policy.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    # verl's Megatron spelling: override_config.model_config.
    nested = _hf(model_dir, override_config={"model_config": {"max_position_embeddings": 300}})
    assert nested.model.config.max_position_embeddings == 300


def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(model_dir: Path
                                                                         ) -> None:
    plain = _hf(model_dir, training=True)
    ckpt = _hf(model_dir, training=True, enable_gradient_checkpointing=True)
    rollout_side = _hf(model_dir, enable_gradient_checkpointing=True)  # rollouter: ignored
    assert ckpt.gradient_checkpointing and not rollout_side.gradient_checkpointing
    plain.train()
    ckpt.train()
    b = _batch(plain)
    grads = []
    for policy in (plain, ckpt):
        logp, _ = policy.logprobs_and_entropy(b.input_ids, b.attention_mask, b.response_len)
        logp[b.response_mask.bool()].sum().backward()
        grads.append([p.grad for p in policy.parameters()])
    for a, c in zip(*grads, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)
    # Generation (inference mode, KV cache) still works and matches the plain model.
    assert ckpt.generate(PROMPTS, 5, 1.0, seed=3).tokens == plain.generate(
        PROMPTS, 5, 1.0, seed=3).tokens
    assert ckpt.training  # generate restored the training mode


def test_checkpointing_reruns_the_layers(model_dir: Path) -> None:
    ckpt = _hf(model_dir, training=True, enable_gradient_checkpointing=True)
    ckpt.train()
    layer = ckpt.model.model.layers[0]
    runs = []
    inner = layer.self_attn
    b = _batch(ckpt)
    inner.register_forward_hook(lambda *_: runs.append(1))
    logp, _ = ckpt.logprobs_and_entropy(b.input_ids, b.attention_mask, b.response_len)
    assert len(runs) == 1
    logp[b.response_mask.bool()].sum().backward()
    assert len(runs) == 2  # recomputed in the backward pass
    # ... while dropout stays off: the attention module itself is not in training mode.
    assert not inner.training and layer.training


def _write_config(tmp_path: Path, config: dict[str, object]) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_context_length_is_checked_at_config_time(model_dir: Path, tmp_path: Path) -> None:
    hf = ["model.kind=hf", f"model.path={model_dir}"]
    # The digits task: prompts of max_digits + 2 = 6 tokens; the model's context is 4096.
    assert load_config(None, [*hf, "rollout.max_new_tokens=4090"]).rollout.max_new_tokens == 4090
    with pytest.raises(ConfigError) as info:
        load_config(None, [*hf, "rollout.max_new_tokens=4091"])
    assert info.value.key == "rollout.max_new_tokens"
    for text in ("4091", "4097", "max_position_embeddings=4096", str(model_dir)):
        assert text in info.value.message
    # override_config's max_position_embeddings is the model's context.
    yaml = tmp_path / "c.yaml"
    yaml.write_text("model:\n  override_config:\n    max_position_embeddings: 512\n")
    assert load_config(yaml, [*hf, "rollout.max_new_tokens=400"]).rollout.max_new_tokens == 400
    with pytest.raises(ConfigError):
        load_config(yaml, [*hf, "rollout.max_new_tokens=507"])


def test_gpt2_and_nested_context_keys(tmp_path: Path) -> None:
    gpt2 = _write_config(tmp_path, {"model_type": "gpt2", "n_positions": 16})
    with pytest.raises(ConfigError, match="n_positions=16"):
        load_config(None, ["model.kind=hf", f"model.path={gpt2}", "rollout.max_new_tokens=11"])
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 8}}))
    with pytest.raises(ConfigError, match=r"text_config\.max_position_embeddings=8"):
        load_config(None, ["model.kind=hf", f"model.path={vl}", "rollout.max_new_tokens=5"])


def test_a_model_path_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.kind=hf", f"model.path={tmp_path / 'nowhere'}"])
    assert info.value.key == "model.path" and "config.json" in info.value.message
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.kind=hf", f"model.path={bad}"])
    assert info.value.key == "model.path" and "not valid JSON" in info.value.message
