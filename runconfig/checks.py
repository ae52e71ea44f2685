"""Checks across keys, run once a config is whole: each raises a :class:`ConfigError`
naming the key to change, before anything starts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from runconfig.errors import ConfigError
from runconfig.rejection import RejectionError, rejection_rules
from runconfig.schema import Config

__all__ = ["check_cross_fields"]


def check_cross_fields(cfg: Config) -> None:
    """Values that are each valid but do not fit together (exit 2 naming a key)."""
    _check_model(cfg)
    _check_engine(cfg)
    _check_task(cfg)
    _check_profiler(cfg)
    _check_checkpoint_contents(cfg)
    _check_redis_cluster(cfg)
    _check_ranks(cfg)
    _check_reward_bounds(cfg)
    _check_record(cfg)
    _check_rejection(cfg)
    _check_val_only(cfg)
    _check_multi_turn(cfg)
    _check_dataset_class(cfg)


def _check_dataset_class(cfg: Config) -> None:
    """verl's ``data.custom_cls`` makes the records from the data files: both keys, and files
    for it to read (the class itself is loaded with the data: tasks.dataset_class)."""
    custom = cfg.data.custom_cls
    if custom.path is None:
        if custom.name is not None:
            raise ConfigError("data.custom_cls.name", "names a class of data.custom_cls.path, "
                              "which is not set")
        return
    if not custom.name:
        raise ConfigError("data.custom_cls.name", f"names the dataset class of {custom.path} "
                          "(data.custom_cls.path); it is not set")
    if cfg.data.train_files is None and cfg.data.val_files is None:
        raise ConfigError("data.custom_cls.path", "makes records from data.train_files and "
                          "data.val_files, and neither is set")


def _check_rejection(cfg: Config) -> None:
    """verl's rejection sampling options and thresholds read as verl reads them."""
    try:
        rejection_rules(cfg.trainer.rollout_rs, cfg.trainer.rollout_rs_threshold)
    except RejectionError as exc:
        raise ConfigError(f"trainer.{exc.key}", str(exc)) from None


def _check_val_only(cfg: Config) -> None:
    """A validation-only run validates something: verl's ``val_only`` validates only when
    ``val_before_train`` holds and there are validation files (else it exits having done
    nothing, which here is refused); it trains no step, so none can be profiled."""
    if not cfg.trainer.val_only:
        return
    if not cfg.data.val_files:
        raise ConfigError("trainer.val_only", "validates the model on data.val_files, which "
                          "is not set")
    if not cfg.trainer.val_before_train:
        raise ConfigError("trainer.val_only", "with trainer.val_before_train=False validates "
                          "nothing (verl's val_only validates only before training)")
    p = cfg.global_profiler
    if p.tool is not None and p.steps:
        raise ConfigError("global_profiler.steps", f"steps {list(p.steps)}: trainer.val_only="
                          "True trains no step to profile")


def _check_multi_turn(cfg: Config) -> None:
    """Conversations need tools to call, and the model's Hugging Face tokenizer and chat
    template to write tool turns with (the built-in tasks' char tokenizer has neither); the
    tool files are read when the data are (tasks.verl_data.agent_options)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    if cfg.model.kind != "hf":
        raise ConfigError("rollout.multi_turn.enable", "conversations with tools need a Hugging "
                          "Face model and its chat template (actor_rollout_ref.model.path)")
    if not (mt.tool_config_path or mt.function_tool_path):
        raise ConfigError("rollout.multi_turn.enable", "no tools: set rollout.multi_turn."
                          "tool_config_path or function_tool_path (verl's keys)")


def _check_record(cfg: Config) -> None:
    """verl's ``rollout_data_dir`` dump is written with the run's record (trainer.record)."""
    if cfg.trainer.rollout_data_dir is not None and cfg.run.record == "none":
        raise ConfigError("trainer.rollout_data_dir",
                          "the generations are dumped as the run's record is written: set "
                          "run.record=all or trained (run.record=none keeps no sample)")


def _check_reward_bounds(cfg: Config) -> None:
    """The rewards the trainer accepts: a finite range, low below high."""
    low, high = cfg.reward.bounds
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ConfigError("reward.bounds", f"[{low}, {high}] must be two finite numbers, "
                          "the first below the second")


def _check_ranks(cfg: Config) -> None:
    """Trainer ranks (trainer.ranks): every rank needs rows of each mini-batch, a node's
    place among the nodes, and a meeting port known to every node."""
    tc = cfg.trainer
    world = tc.nnodes * tc.n_gpus_per_node
    if tc.node_rank >= tc.nnodes:
        raise ConfigError("trainer.node_rank", f"{tc.node_rank} is not below trainer.nnodes="
                          f"{tc.nnodes}")
    if tc.nnodes > 1 and tc.master_port is None:
        raise ConfigError("trainer.master_port", f"needed with trainer.nnodes={tc.nnodes}: "
                          "every node's ranks meet rank 0 there")
    rows = tc.ppo_mini_batch_size * cfg.rollout.n
    if world > 1 and rows < world:
        raise ConfigError("trainer.n_gpus_per_node", f"{world} trainer ranks, but a "
                          f"mini-batch has {rows} responses (ppo_mini_batch_size x rollout.n): "
                          "every rank needs at least one")


def _check_engine(cfg: Config) -> None:
    """vLLM loads a Hugging Face model directory, not the built-in toy model, and refuses
    an engine step smaller than its batch of sequences."""
    rc = cfg.rollout
    if rc.name != "vllm":
        return
    if cfg.model.kind != "hf":
        raise ConfigError("rollout.name", f"vllm generates with a Hugging Face model "
                          f"(model.kind: hf and model.path), not model.kind {cfg.model.kind}")
    if rc.max_num_batched_tokens < rc.max_num_seqs:
        raise ConfigError("rollout.max_num_batched_tokens",
                          f"{rc.max_num_batched_tokens} is below rollout.max_num_seqs="
                          f"{rc.max_num_seqs}: vLLM needs room for one token of every "
                          "sequence in an engine step")


def _check_redis_cluster(cfg: Config) -> None:
    """A Redis Cluster (``redis.cluster: true``) is reached over TCP: redis:// or rediss://,
    and there is no embedded one (``rlbus up`` without redis.url starts a single server)."""
    if not cfg.redis.cluster:
        return
    if cfg.redis.url is None:
        raise ConfigError("redis.cluster", "true needs redis.url naming a node of the cluster "
                          "(the embedded Redis is a single server)")
    scheme = cfg.redis.url.partition("://")[0].lower()
    if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        raise ConfigError("redis.url", f"a Redis Cluster (redis.cluster: true) needs a "
                          f"redis:// or rediss:// URL, not {scheme}://")


def _check_checkpoint_contents(cfg: Config) -> None:
    """``hf_model`` (verl's save_contents) writes a Hugging Face directory per checkpoint:
    only a Hugging Face model has one."""
    if "hf_model" in cfg.trainer.checkpoint_contents and cfg.model.kind != "hf":
        raise ConfigError(
            "trainer.checkpoint_contents",
            f"hf_model needs model.kind=hf (a Hugging Face model from model.path); the "
            f"built-in model.kind={cfg.model.kind} has no Hugging Face form")


def _check_model(cfg: Config) -> None:
    m, t = cfg.model, cfg.task
    if m.d_model % m.n_heads:
        raise ConfigError("model.n_heads", f"must divide model.d_model={m.d_model}")
    if m.kind == "hf" and not m.path:
        raise ConfigError("model.path", "model.kind=hf needs a local model directory")
    if m.kind == "hf":
        _check_hf_context(cfg)
    elif cfg.trainer.fsdp_param_dtype not in ("auto", "fp32", "float32"):
        raise ConfigError("trainer.fsdp_param_dtype", f"{cfg.trainer.fsdp_param_dtype} needs "
                          f"model.kind=hf: the built-in model.kind={m.kind} computes in fp32")
    if m.kind == "tiny" and t.kind == "digits":
        # Learned absolute positions: a prompt (bos, digits, separator) plus its response
        # (continuations re-enter as prompts) must fit in model.max_len.
        need = t.max_digits + 2 + cfg.rollout.max_new_tokens
        if need > m.max_len:
            raise ConfigError("model.max_len", f"{m.max_len} is too short: prompts of "
                              f"{t.max_digits + 2} tokens plus rollout.max_new_tokens="
                              f"{cfg.rollout.max_new_tokens} need model.max_len >= {need}")


# Where a config.json keeps the context length (GPT-2's is n_positions, others' their own).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def _hf_config_json(path: str) -> dict[str, Any]:
    """``path/config.json`` as JSON (no transformers, no torch: config time stays fast)."""
    file = Path(path) / "config.json"
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError("model.path", f"{path} has no config.json: model.kind=hf needs a "
                          "local Hugging Face model directory (nothing is downloaded)") from None
    except OSError as exc:
        raise ConfigError("model.path", f"cannot read {file}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError("model.path", f"{file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("model.path", f"{file} does not hold a JSON object")
    return data


def _overlay(config: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``override`` set on it as verl's override_config does (nested
    mappings update sub-configs; a ``model_config`` mapping stands for the whole)."""
    if isinstance(override.get("model_config"), dict):
        override = override["model_config"]
    out = dict(config)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _overlay(out[key], value)
        else:
            out[key] = value
    return out


def _context_length(config: dict[str, Any]) -> tuple[int, str] | None:
    """The model's context length and the key holding it (a VL model's in text_config)."""
    text = config.get("text_config")
    for scope, prefix in ((config, ""), (text if isinstance(text, dict) else {}, "text_config.")):
        for key in _CONTEXT_KEYS:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value, prefix + key
    return None


def _check_hf_context(cfg: Config) -> None:
    """The longest prompt plus the longest response must fit the model's context: a longer
    sequence fails deep in the model ("index out of range") after many rollouts."""
    m = cfg.model
    assert m.path is not None
    found = _context_length(_overlay(_hf_config_json(m.path), dict(m.override_config)))
    if found is None:
        return
    limit, key = found
    if cfg.data.train_files:
        prompt, what = cfg.data.max_prompt_length, "data.max_prompt_length"
    elif cfg.task.kind == "digits":
        prompt, what = cfg.task.max_digits + 2, "the digits task's longest prompt"
    else:
        prompt, what = 1, "a one-token prompt"
    need = prompt + cfg.rollout.max_new_tokens
    if need > limit:
        by = " with model.override_config" if m.override_config else ""
        raise ConfigError("rollout.max_new_tokens",
                          f"{what} ({prompt} tokens) + rollout.max_new_tokens "
                          f"({cfg.rollout.max_new_tokens}) = {need} tokens exceed the model's "
                          f"context: {key}={limit} in {m.path}/config.json{by}")


def _check_task(cfg: Config) -> None:
    t = cfg.task
    if t.min_digits > t.max_digits:
        raise ConfigError("task.min_digits", f"must be <= task.max_digits={t.max_digits}")
    if t.kind == "jsonl" and not t.path:
        raise ConfigError("task.path", "task.kind=jsonl needs a JSONL file")


def _check_profiler(cfg: Config) -> None:
    p = cfg.global_profiler
    total = cfg.trainer.total_training_steps
    trigger = cfg.async_training.trigger_parameter_sync_step
    # verl's unit: a step is a parameter version (trigger updates), and the run's last one is
    # its last full sync. Refused with the tool off too: a run that never reaches a step
    # cannot profile it once the tool is turned on (a resume keeps the steps it recorded).
    from runconfig.stepunit import last_version  # here: this check is its only user in load

    last = last_version(total, trigger)
    late = [s for s in p.steps if s > last]
    if late and trigger == 1:
        raise ConfigError(
            "global_profiler.steps", f"steps {late} are past trainer.total_training_steps={total}"
        )
    if late:
        raise ConfigError(
            "global_profiler.steps",
            f"steps {late} are past the run's last step {last}: steps count parameter versions "
            f"as in verl, one per async_training.trigger_parameter_sync_step={trigger} "
            f"updates, and trainer.total_training_steps={total} updates make {last}",
        )
    if len(set(p.steps)) != len(p.steps):
        raise ConfigError("global_profiler.steps", f"steps {p.steps} repeat a step")
    if p.tool is not None and not p.roles:
        raise ConfigError("global_profiler.roles", "profiling needs at least one role")
    # global_profiler.ranks may name rollouters past rollout.replicas: rollouters join a running
    # run (docs/operations.md); the service counts their traces and never waits for them.
