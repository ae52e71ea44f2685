"""HFPolicy: a tiny random GPT-2 saved locally, driven through the policy boundary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from policy import Policy, build_policy
from trainer.grpo import build_batch

transformers = pytest.importorskip("transformers")

from policy.hf import HFPolicy  # noqa: E402

EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
        bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # a peakier random model, so mistakes in the layout show up
        for p in model.parameters():
            p.mul_(4.0)
    path = tmp_path_factory.mktemp("tiny_gpt2")
    model.save_pretrained(path)
    return path


PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 3, 3, 3, 3], [1]]


def test_load_generate_and_logprobs(model_dir: Path) -> None:
    torch.set_num_threads(1)
    policy = HFPolicy.from_pretrained(model_dir, device="cpu")
    assert isinstance(policy, Policy)
    assert (policy.eos_id, policy.pad_id) == (EOS, 0)
    prompts = PROMPTS * 4
    gen = policy.generate(prompts, 6, temperature=1.0, seed=0)
    assert len(gen.tokens) == len(prompts)
    for toks, lp, fin in zip(gen.tokens, gen.logprobs, gen.finished, strict=True):
        assert 1 <= len(toks) <= 6 and len(lp) == len(toks) and lp.dtype == np.float32
        assert EOS not in toks[:-1] and fin == (toks[-1] == EOS)
    assert policy.generate(prompts, 6, 1.0, seed=0).tokens == gen.tokens

    # Rollout log-probs (left-padded prompts, KV cache) equal a training forward pass.
    policy.train()
    b = build_batch(list(zip(prompts, gen.tokens, gen.logprobs, strict=True)), policy.pad_id)
    logp, ent = policy.logprobs_and_entropy(b.input_ids, b.attention_mask, b.response_len)
    m = b.response_mask.bool()
    torch.testing.assert_close(logp[m].detach(), b.old_logprobs[m], atol=2e-5, rtol=1e-5)
    assert (ent[m] >= 0).all()
    logp[m].sum().backward()  # differentiable
    assert any(p.grad is not None for p in policy.parameters())


def test_chunked_generation_logprobs_match(model_dir: Path) -> None:
    # partial_rollout: continue from prompt + tokens so far, 2 tokens at a time.
    policy = HFPolicy.from_pretrained(model_dir, device="cpu")
    g = torch.Generator().manual_seed(1)
    toks: list[list[int]] = [[] for _ in PROMPTS]
    logps: list[list[float]] = [[] for _ in PROMPTS]
    for _ in range(3):
        live = [i for i, t in enumerate(toks) if not t or t[-1] != EOS]
        if not live:
            break
        out = policy.generate([PROMPTS[i] + toks[i] for i in live], 2, 1.0, generator=g)
        for i, t, lp in zip(live, out.tokens, out.logprobs, strict=True):
            toks[i] += t
            logps[i] += lp.tolist()
    b = build_batch(list(zip(PROMPTS, toks, logps, strict=True)), policy.pad_id)
    with torch.no_grad():
        logp, _ = policy.logprobs_and_entropy(b.input_ids, b.attention_mask, b.response_len)
    m = b.response_mask.bool()
    torch.testing.assert_close(logp[m], b.old_logprobs[m], atol=2e-5, rtol=1e-5)


def test_weights_round_trip_and_build(model_dir: Path) -> None:
    a = HFPolicy.from_pretrained(model_dir, device="cpu")
    b = build_policy({"kind": "hf", "path": str(model_dir)}, device="cpu")
    assert isinstance(b, HFPolicy)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.5)
    blob = a.state_bytes()
    assert blob == a.state_bytes()
    assert b.state_bytes() != blob
    b.load_bytes(blob)
    ga, gb = a.generate(PROMPTS, 5, 1.0, seed=3), b.generate(PROMPTS, 5, 1.0, seed=3)
    assert ga.tokens == gb.tokens
    for x, y in zip(ga.logprobs, gb.logprobs, strict=True):
        np.testing.assert_array_equal(x, y)


def test_never_from_hub(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        HFPolicy.from_pretrained(tmp_path / "gpt2")
    with pytest.raises(FileNotFoundError):
        HFPolicy.from_pretrained("gpt2")
    with pytest.raises(ValueError, match=r"policy\.path"):
        build_policy({"kind": "hf"})
