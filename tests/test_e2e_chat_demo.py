"""The chat demo's config (configs/chat_demo.yaml, verl's keys) run end to end, shortened.

``rlbus up`` on the files ``tasks.chatdemo`` builds: embedded Redis, rollouter, trainer and
metrics logger as processes. The run must finish (not wait for ever on its last validation
after a checkpoint's retention archived the answers: it once did), validate per data source
before training and every ``test_freq`` versions, and leave HF directories that load in
transformers with the trainer's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import run_cli

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def test_the_chat_demo_config_runs_validates_and_exports(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    import torch

    from tasks.chatdemo import DATA_SOURCE, build_demo

    files = build_demo(tmp_path / "chatdemo", n_train=256, n_val=16)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    done = run_cli(
        "up", "--config", str(ROOT / "configs" / "chat_demo.yaml"),
        f"data.train_files={files / 'train.parquet'}", f"data.val_files={files / 'val.parquet'}",
        f"custom_reward_function.path={files / 'reward.py'}",
        f"actor_rollout_ref.model.path={files / 'model'}",
        "trainer.total_training_steps=12", "trainer.save_freq=4", "trainer.test_freq=4",
        "trainer.logger=[console]", f"run.output_dir={out}", f"trainer.default_local_dir={ckpt}",
        cwd=tmp_path, timeout_s=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = [p.parent for p in out.glob("*/config.yaml")]
    shown = run_cli("inspect", "--run", run_dir.name, "--json", f"run.output_dir={out}",
                    cwd=tmp_path, timeout_s=120)
    assert shown.returncode == 0, shown.stderr
    events = [json.loads(line) for line in shown.stdout.splitlines()]
    vals = [e for e in events if e.get("type") == "ValidationFinished"]
    assert sorted(e["version"] for e in vals) == [0, 4, 8, 12]
    assert all(f"val-core/{DATA_SOURCE}/reward/mean@1" in e["metrics"] for e in vals)
    steps = [e for e in events if e.get("type") == "StepFinished"]
    assert [e["step"] for e in steps] == list(range(1, 13))
    assert all("timing_s/gen" in e["metrics"] and "response_length/mean" in e["metrics"]
               for e in steps)
    # The last checkpoint's HF directory holds the weights the trainer saved.
    hf = ckpt / "global_step_12" / "actor" / "huggingface"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf))
    saved = torch.load(ckpt / "step-000012.pt", map_location="cpu", weights_only=True)
    state = saved["model"] if "model" in saved else saved
    theirs = {k.removeprefix("model."): v for k, v in state.items()}
    compared = [name for name in model.state_dict() if name in theirs]
    assert len(compared) >= len(theirs) - 1  # lm_head is tied to wte (one of them saved)
    for name in compared:
        assert torch.equal(model.state_dict()[name], theirs[name]), name
    assert transformers.AutoTokenizer.from_pretrained(str(hf)).chat_template
