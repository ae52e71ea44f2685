"""In-process synchronous GRPO on the chat demo (tasks/chatdemo.py): the reference curve.

The same job as ``configs/chat_demo.yaml`` without the bus: the tiny Qwen2 built by
``tasks.chatdemo``, its chat template, the parquet records, the demo's reward file (verl's
signature), the trainer's own update function (``trainer.update.grpo_update``). Every
``--val-every`` steps it validates greedily on the validation file, as rlbus's validation
does (verl's ``val_kwargs``: greedy, n 1), and stops when the validation reward reaches
``--target``.

    .venv/bin/python bench/sync_grpo_chat.py [--root outputs/chatdemo] [--target 0.9]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from policy.hf import HFPolicy
from runconfig import load_config
from runschema.messages import Array, Sample
from tasks.chatdemo import build_demo
from trainer.update import grpo_update

__all__ = ["main"]

SHOW = 0  # --show: validation generations printed per report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", default="outputs/chatdemo", help="tasks.chatdemo files")
    p.add_argument("--config", default="configs/chat_demo.yaml",
                   help="rlbus config whose trainer/rollout keys are used")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=0, help="validation generations to print")
    return p.parse_args(argv)


def _reward_fn(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("chat_reward", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def _encode(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def _rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(str(path)).to_pylist()


def _score(fn: Any, row: dict[str, Any], text: str) -> float:
    out = fn(row["data_source"], text, row["reward_model"]["ground_truth"], row["extra_info"])
    return float(out["score"] if isinstance(out, dict) else out)


def validate(policy: HFPolicy, tok: Any, rows: list[dict[str, Any]], fn: Any,
             max_new: int, eos: Any) -> float:
    prompts = [_encode(tok, list(r["prompt"])) for r in rows]
    out = policy.generate(prompts, max_new_tokens=max_new, temperature=0.0, eos_id=eos)
    texts = [tok.decode(t, skip_special_tokens=True) for t in out.tokens]
    scores = [_score(fn, r, text) for r, text in zip(rows, texts, strict=True)]
    if SHOW:
        for r, t, sc in list(zip(rows, out.tokens, scores, strict=True))[:SHOW]:
            print(f"  {r['prompt'][0]['content']!r} -> {tok.convert_ids_to_tokens(t)} {sc:.2f}")
    return float(np.mean(scores))


def run(args: argparse.Namespace) -> int:
    global SHOW
    SHOW = args.show
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    root = build_demo(args.root)
    cfg = load_config(args.config, [f"actor_rollout_ref.model.path={root / 'model'}"],
                      on_warning=lambda m: None)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(root / "model"))
    policy = HFPolicy.from_pretrained(root / "model", device="cpu")
    # Every EOS id the model lists (generation_config), where the policy knows them.
    eos: Any = getattr(policy, "eos_ids", None) or tok.eos_token_id
    fn = _reward_fn(root / "reward.py")
    train, val = _rows(root / "train.parquet"), _rows(root / "val.parquet")
    tc, rc = cfg.trainer, cfg.rollout
    optim = torch.optim.AdamW(policy.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    per_step = tc.ppo_mini_batch_size * cfg.async_training.require_batches
    gen = torch.Generator().manual_seed(args.seed)
    t0, cursor = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        rows = [train[(cursor + i) % len(train)] for i in range(per_step)]
        cursor += per_step
        prompts = [_encode(tok, list(r["prompt"])) for r in rows]
        out = policy.generate([p for p in prompts for _ in range(rc.n)],
                              max_new_tokens=rc.max_new_tokens, temperature=rc.temperature,
                              eos_id=eos, generator=gen)
        groups: list[list[Sample]] = []
        for i, (r, p) in enumerate(zip(rows, prompts, strict=True)):
            group = []
            for j in range(rc.n):
                k = i * rc.n + j
                toks = out.tokens[k]
                text = tok.decode(toks, skip_special_tokens=True)
                group.append(Sample(
                    sample_id=f"t{step}-{i}/{j}", ticket_id=f"t{step}-{i}", prompt_id=str(i),
                    index=j, n=rc.n, prompt_tokens=Array.of(np.asarray(p, np.int32)),
                    response_tokens=Array.of(np.asarray(toks, np.int32)),
                    logprobs=Array.of(out.logprobs[k]), reward=_score(fn, r, text),
                    min_version=step - 1, max_version=step - 1))
            groups.append(group)
        metrics = grpo_update(policy, optim, groups, tc, temperature=rc.temperature,
                              version=step - 1, device=torch.device("cpu"))
        if step % args.val_every == 0 or step == 1:
            v = validate(policy, tok, val, fn, rc.max_new_tokens, eos)
            print(f"step {step} reward {metrics['critic/score/mean']:.3f} val {v:.3f} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
            if v >= args.target:
                print(f"reached {args.target} at step {step}", flush=True)
                return 0
    return 1


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
