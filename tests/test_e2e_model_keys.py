"""verl's model and optimizer keys through the whole system: a tiny Qwen2 (tasks.chatdemo) in
bf16 with gradient checkpointing, top-p / top-k sampling, micro-batches, the KL loss and an lr
warm-up, trained by real trainer and rollouter processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runschema.messages import RunFinished, Sample, StepFinished
from tests.procs import FAST, Procs, events_of

pytest.importorskip("transformers", reason="the hf extra is not installed")

from tasks.chatdemo import build_model


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_model_and_optimizer_keys_end_to_end(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    model = build_model(tmp_path / "model")
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}", *FAST,
            "model.kind=hf", f"model.path={model}", "model.dtype=bf16",
            "model.enable_gradient_checkpointing=true",
            "rollout.top_p=0.9", "rollout.top_k=20", "rollout.max_new_tokens=6",
            "trainer.micro_batch_size=3", "trainer.use_kl_loss=true", "trainer.kl_loss_coef=0.1",
            "trainer.lr=1e-3", "trainer.lr_warmup_steps=2", "trainer.weight_decay=0.01",
            "trainer.zero_adv=keep", "trainer.total_training_steps=3"]
    procs = Procs(tmp_path / "logs")
    try:
        procs.spawn("rollouter0", "rollouter", *args)
        procs.spawn("trainer", "trainer", *args)
        assert procs.wait("trainer", 240) == 0, procs.log("trainer")
        assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    finally:
        procs.kill_all()
    events = await events_of(bus, run_keys.events)
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert [e.step for e in steps] == [1, 2, 3]
    assert any(isinstance(e, RunFinished) for e in events)
    # The warm-up: lr 0, then half, then all of it (one schedule step per training step).
    assert [e.metrics["actor/lr"] for e in steps] == pytest.approx([0.0, 5e-4, 1e-3])
    # The policy is its reference until an update with lr > 0 has moved it.
    kl = [e.metrics["actor/kl_loss"] for e in steps]
    assert kl[0] == 0.0 and kl[1] == 0.0 and kl[2] > 0.0
    assert all(e.metrics["actor/kl_coef"] == 0.1 for e in steps)
    assert all(math.isfinite(e.metrics["actor/grad_norm"]) for e in steps)
    samples = [m async for _, m in bus.read_all(run_keys.samples) if isinstance(m, Sample)]
    assert samples and all(1 <= len(s.response_tokens) <= 6 for s in samples)
