"""The vLLM engine's settings (``rollout.*`` keys, verl's meanings) and the environment its
CPU backend reads: what :mod:`rollouter.vllm_engine` starts ``vllm.LLM`` with. Imports no vLLM."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runconfig import Config

__all__ = ["DTYPES", "VllmOptions", "engine_env", "environ", "is_cpu", "max_model_len",
           "options_from_config"]

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}
# Room the prompt may take when rollout.max_model_len is not set and the data section does
# not say (data.max_prompt_length's default).
_DEFAULT_PROMPT_ROOM = 512


@dataclass(frozen=True)
class VllmOptions:
    """The engine's settings (``rollout.*`` keys of the same names, verl's meanings).

    ``max_model_len`` None: room for the prompt plus ``max_new_tokens``, capped by the model's
    ``max_position_embeddings``. ``threads``: the OpenMP threads of the CPU worker
    (rollout.threads). ``kv_cache_gib``: the CPU KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE);
    None: ``gpu_memory_utilization`` decides, as on a GPU."""

    dtype: str = "fp32"
    seed: int = 0
    max_model_len: int | None = None
    prompt_room: int = _DEFAULT_PROMPT_ROOM
    max_new_tokens: int = 512
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = True
    tensor_model_parallel_size: int = 1
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    threads: int | None = None
    kv_cache_gib: int | None = None
    hf_overrides: dict[str, Any] | None = None


def max_model_len(opts: VllmOptions, max_pos: int | None) -> int:
    """rollout.max_model_len, or the prompt's room plus the response's, within the model's
    positions (a longer window would only reserve KV cache no request can use)."""
    if opts.max_model_len is not None:
        return int(opts.max_model_len)
    want = opts.prompt_room + opts.max_new_tokens
    return min(want, max_pos) if max_pos else want


@contextlib.contextmanager
def environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables while the engine starts (its processes inherit them), then
    put back what was there: the rollouter's own threads are not to change."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def engine_env(opts: VllmOptions) -> dict[str, str]:
    """What vLLM's CPU backend reads from the environment; a value the user set wins."""
    env: dict[str, str] = {}
    if opts.tensor_model_parallel_size == 1:
        # The engine core in this process, on the calling thread: the rollouter's profiler
        # (torch.profiler on its worker thread) records the engine's kernels, and a killed
        # rollouter leaves no engine process behind.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if opts.kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(opts.kv_cache_gib))
    if opts.threads is not None:
        # vLLM binds one OpenMP thread per physical core by default: on a shared machine,
        # rollout.threads is the budget instead, unbound.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(int(opts.threads))
    return {k: v for k, v in env.items() if k not in os.environ}


def options_from_config(cfg: Config) -> tuple[Path, VllmOptions]:
    """(model directory, options) from a run's config; ValueError naming the key at fault
    when the config cannot run on vLLM."""
    model, rc = cfg.model, cfg.rollout
    if model.kind != "hf":
        raise ValueError("invalid config key 'model.kind': rollout.name=vllm needs "
                         f"model.kind=hf (a local HF model directory), got {model.kind!r}")
    if not model.path:
        raise ValueError("invalid config key 'model.path': rollout.name=vllm needs "
                         "a local model directory")
    data = getattr(cfg, "data", None)
    return Path(model.path), VllmOptions(
        dtype=model.dtype,
        seed=rc.seed,
        max_model_len=getattr(rc, "max_model_len", None),
        prompt_room=getattr(data, "max_prompt_length", _DEFAULT_PROMPT_ROOM),
        max_new_tokens=rc.max_new_tokens,
        gpu_memory_utilization=getattr(rc, "gpu_memory_utilization", 0.5),
        max_num_seqs=getattr(rc, "max_num_seqs", 1024),
        max_num_batched_tokens=getattr(rc, "max_num_batched_tokens", 8192),
        enforce_eager=getattr(rc, "enforce_eager", True),
        tensor_model_parallel_size=getattr(rc, "tensor_model_parallel_size", 1),
        enable_prefix_caching=getattr(rc, "enable_prefix_caching", True),
        enable_chunked_prefill=getattr(rc, "enable_chunked_prefill", True),
        threads=getattr(rc, "threads", None),
        # On a CPU, vLLM sizes its KV cache from this (GiB), not from gpu_memory_utilization.
        kv_cache_gib=1 if is_cpu() else None,
        hf_overrides=_hf_overrides(model.override_config),
    )


def _hf_overrides(override: Mapping[str, Any]) -> dict[str, Any] | None:
    """``model.override_config`` as vLLM's ``hf_overrides``: what HFPolicy sets on the model's
    config (``policy.hf.apply_override_config``): verl's ``model_config`` spelling stands for
    the whole override, and ``attn_implementation`` is a loading option, not config."""
    if isinstance(override.get("model_config"), Mapping):
        override = override["model_config"]
    out = {k: v for k, v in override.items() if k != "attn_implementation"}
    return out or None


def is_cpu() -> bool:
    return not torch.cuda.is_available()
