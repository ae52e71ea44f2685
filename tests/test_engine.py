"""The engine boundary (rollouter.engine): rollout.name picks the engine, a verl line's
``vllm`` runs on the built-in engine where vLLM is not installed (and says so), the built-in
engine is the policy's decode loop, and samples carry the version the engine holds."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from bus import Bus
from policy import Generation, build_policy
from rollouter import engine as engine_mod
from rollouter.answers import Seq
from rollouter.app import Rollouter
from rollouter.batch import BatchRollout
from rollouter.engine import Engine, PolicyEngine, build_engine
from runconfig import ConfigError, load_config
from runschema.messages import PromptTicket

DEVICE = torch.device("cpu")


def test_rollout_name_defaults_to_the_builtin_engine_and_takes_verls_keys() -> None:
    assert load_config(None, []).rollout.name == "hf"
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=hf",
                             "actor_rollout_ref.rollout.max_num_seqs=64",
                             "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
                             "run.defaults=rlbus"])
    assert (cfg.rollout.name, cfg.rollout.max_num_seqs) == ("hf", 64)
    assert cfg.rollout.gpu_memory_utilization == 0.3


def test_vllm_with_the_builtin_toy_model_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.name=vllm"])
    assert info.value.key == "rollout.name" and "model.kind" in str(info.value)


def test_an_engine_step_smaller_than_its_sequences_is_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    from tasks.chatdemo import build_model

    model = build_model(tmp_path / "m", arch="gpt2", hidden=64)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.name=vllm", "model.kind=hf", f"model.path={model}",
                           "rollout.max_num_batched_tokens=64", "rollout.max_num_seqs=256"])
    assert info.value.key == "rollout.max_num_batched_tokens"
    load_config(None, ["rollout.name=vllm", "model.kind=hf", f"model.path={model}",
                       "rollout.max_num_batched_tokens=64", "rollout.max_num_seqs=64"])


def test_the_builtin_engine_generates_as_its_policy_and_holds_the_version_it_loaded() -> None:
    cfg = load_config(None, [])
    engine = build_engine(cfg, DEVICE, _no_warning)
    assert isinstance(engine, PolicyEngine) and isinstance(engine, Engine)
    assert engine.name == "hf" and engine.version == -1
    twin = build_policy({"kind": "tiny"}, DEVICE)
    prompts = [[1, 5, 6, 7], [1, 8]]
    mine = engine.generate(prompts, 4, 1.0, None, generator=torch.Generator().manual_seed(3))
    theirs = twin.generate(prompts, max_new_tokens=4, temperature=1.0,
                           generator=torch.Generator().manual_seed(3))
    assert mine.tokens == theirs.tokens
    state = {k: v + 0.25 for k, v in twin.weights().items()}
    engine.load_state(state, 7)
    assert engine.version == 7
    for name, tensor in engine.policy.weights().items():
        assert torch.equal(tensor, state[name]), name


def test_vllm_asked_where_it_is_not_installed_runs_builtin_and_warns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_mod, "vllm_installed", lambda: False)
    cfg = load_config(None, [])
    cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, name="vllm"))
    warnings: list[str] = []
    engine = build_engine(cfg, DEVICE, warnings.append)
    assert isinstance(engine, PolicyEngine)
    assert len(warnings) == 1 and "make vllm" in warnings[0]


class _LaggingEngine:
    """An engine that holds v3 whatever the rollouter thinks it loaded."""

    name = "stub"
    eos_ids = (2,)
    version = 3

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 1.0, eos_id: Any = None, **_: Any) -> Generation:
        return Generation([[9, 9] for _ in prompts],
                          [np.full(2, -0.5, np.float32) for _ in prompts], [False] * len(prompts))

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.asyncio
async def test_samples_carry_the_version_the_engine_holds(
    redis_url: str, run_id: str, bus: Bus, tmp_path: Path,
) -> None:
    cfg = load_config(overrides=[f"redis.url={redis_url}", f"run.id={run_id}",
                                 f"run.output_dir={tmp_path}"])
    r = Rollouter(cfg, bus)
    r.context.weights.held.version = 5  # what the rollouter's bookkeeping says
    ticket = PromptTicket(ticket_id="t", prompt_id="p", prompt="12", answer="21", n=2,
                          min_version=0)
    seqs = [Seq(ticket, i, [1, 4, 5], [], []) for i in range(2)]
    BatchRollout(r.context, _LaggingEngine()).generate(seqs, 2)
    assert [(s.min_version, s.max_version, s.tokens) for s in seqs] == [(3, 3, [9, 9])] * 2


def _no_warning(text: str) -> None:
    raise AssertionError(f"unexpected engine warning: {text}")


@pytest.mark.asyncio
async def test_an_engine_that_starts_slowly_claims_nothing_and_is_not_judged(
    redis_url: str, run_id: str, bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM engine's start-up takes minutes (CUDA graph capture; 200+ s under load): the
    heartbeat says the engine is starting and reports no progress counter, which the
    trainer's no-progress judge passes over (trainer.dispatch.no_progress), and no ticket is
    claimed before the engine exists; past rollout.engine_start_timeout_s the start is one
    named failure."""
    from rollouter import app as rollouter_app
    from rollouter.app import EngineStartTimeout
    from trainer.dispatch import no_progress
    from trainer.health import observe_progress

    cfg = load_config(overrides=[f"redis.url={redis_url}", f"run.id={run_id}",
                                 f"run.output_dir={tmp_path}",
                                 "rollout.engine_start_timeout_s=0.5"])
    release = threading.Event()

    def slow_build(*_: object) -> _LaggingEngine:
        release.wait(10)
        return _LaggingEngine()

    monkeypatch.setattr(rollouter_app, "build_engine", slow_build)
    r = Rollouter(cfg, bus)
    hb = r.heartbeat()
    assert hb.state.startswith("engine starting (") and hb.progress is None
    seen = observe_progress({}, [hb], now=0.0)
    assert no_progress({"rollouter-0": [1, 2]}, {c: p.since for c, p in seen.items()},
                       now=10**6, bound=1.0) == {}
    with pytest.raises(EngineStartTimeout, match=r"did not start in 0\.5 s \(rollout\."
                                                 r"engine_start_timeout_s\)"):
        await r._start_engine()
    assert r.loop is None  # the loop that claims tickets starts only with an engine
    release.set()
    r.worker.shutdown(wait=True)
    assert r.engine is not None and r.abandoned
