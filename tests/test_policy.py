"""TinyGPT behind the policy boundary: generation, log-prob consistency, weights, learning."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from policy import Generation, Policy, build_policy, decode_loop, resolve_device
from policy.model import TinyConfig, TinyGPT
from policy.tokenizer import CharTokenizer
from policy.weights import from_bytes, to_bytes
from tasks.digits import digits_reward
from trainer.grpo import build_batch, group_advantages, policy_loss

TOK = CharTokenizer()
PROMPTS = ["12>", "98765>", "4>", "3141>"]


def _ids(texts: list[str]) -> list[list[int]]:
    return [TOK.encode(t, bos=True) for t in texts]


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead


def _recompute(policy: Policy, prompts: list[list[int]], gen: Generation, temperature: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = build_batch(list(zip(prompts, gen.tokens, gen.logprobs, strict=True)),
                        pad_id=policy.pad_id, device=policy.device)
    with torch.no_grad():
        logp, ent = policy.logprobs_and_entropy(batch.input_ids, batch.attention_mask,
                                                batch.response_len, temperature)
    return logp, ent, batch.old_logprobs, batch.response_mask.bool()


def test_build_policy_and_protocol() -> None:
    p = build_policy({"kind": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2}, "cpu")
    assert isinstance(p, TinyGPT) and isinstance(p, Policy)
    assert p.device == torch.device("cpu") and p.cfg.vocab_size == TOK.vocab_size
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Same seed, same weights; the global RNG is not consumed.
    state = torch.random.get_rng_state()
    q = build_policy({"d_model": 32, "n_layers": 1, "n_heads": 2, "seed": 0}, "cpu")
    assert torch.equal(state, torch.random.get_rng_state())
    assert p.state_bytes() == q.state_bytes()
    with pytest.raises(ValueError, match="unknown policy kind"):
        build_policy({"kind": "rnn"})


def test_generate_shapes() -> None:
    policy = TinyGPT()
    prompts = _ids(PROMPTS) * 3
    gen = policy.generate(prompts, max_new_tokens=6, temperature=1.0, seed=0)
    assert len(gen.tokens) == len(gen.logprobs) == len(gen.finished) == len(prompts)
    for toks, lp, fin in zip(gen.tokens, gen.logprobs, gen.finished, strict=True):
        assert 1 <= len(toks) <= 6 and len(lp) == len(toks)
        assert lp.dtype == np.float32 and (lp <= 0).all()
        assert all(0 <= t < policy.cfg.vocab_size for t in toks)
        assert fin == (toks[-1] == TOK.eos_id)
    again = policy.generate(prompts, max_new_tokens=6, temperature=1.0, seed=0)
    assert again.tokens == gen.tokens  # seeded sampling is reproducible
    greedy = policy.generate(prompts, 6, temperature=0.0)
    assert greedy.tokens[:4] == greedy.tokens[4:8]  # same prompt, same greedy answer
    with pytest.raises(ValueError, match="max_len"):
        policy.generate(prompts, max_new_tokens=policy.cfg.max_len)


def test_padding_does_not_change_outputs() -> None:
    # A prompt's greedy answer and log-probs do not depend on what else is in the batch.
    torch.manual_seed(1)
    policy = TinyGPT(TinyConfig(d_model=32, n_layers=2, n_heads=2))
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(5.0)
    alone = policy.generate(_ids(["4>"]), 6, temperature=0.0)
    mixed = policy.generate(_ids(["98765>", "4>", "3141>"]), 6, temperature=0.0)
    assert mixed.tokens[1] == alone.tokens[0]
    np.testing.assert_allclose(mixed.logprobs[1], alone.logprobs[0], atol=1e-5)


def test_eos_stops_each_sequence() -> None:
    # A fake model: row i emits token 5 until step i, then eos (row 3 never).
    eos, vocab = 2, 8

    def step(ids: torch.Tensor, mask: torch.Tensor, cache: int | None
             ) -> tuple[torch.Tensor, int]:
        t = 0 if cache is None else cache + 1
        logits = torch.full((ids.shape[0], ids.shape[1], vocab), -1e9)
        logits[:, -1, 5] = 0.0
        for row in range(3):
            if row <= t:
                logits[row, -1, :] = -1e9
                logits[row, -1, eos] = 0.0
        return logits, t

    gen = decode_loop(step, [[1], [1, 3], [1], [1, 4, 4]], 5, 1.0, eos, 0, torch.device("cpu"))
    assert gen.tokens == [[2], [5, 2], [5, 5, 2], [5, 5, 5, 5, 5]]
    assert gen.finished == [True, True, True, False]
    assert [len(x) for x in gen.logprobs] == [1, 2, 3, 5]
    np.testing.assert_allclose(np.concatenate(gen.logprobs), 0.0, atol=1e-6)


def test_real_model_eos_semantics() -> None:
    policy = TinyGPT()
    gen = policy.generate(_ids(PROMPTS) * 16, 8, temperature=1.5, eos_id=TOK.eos_id, seed=1)
    assert any(gen.finished) and not all(gen.finished)
    for toks in gen.tokens:
        assert TOK.eos_id not in toks[:-1]  # nothing after eos
        if toks[-1] != TOK.eos_id:
            assert len(toks) == 8


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_logprobs_match_recomputation(temperature: float) -> None:
    # The trainer uses rollout log-probs as the PPO old log-probs: they must agree with a
    # training-layout forward pass on the same weights, across different prompt lengths.
    torch.manual_seed(3)
    policy = TinyGPT(TinyConfig(d_model=32, n_layers=2, n_heads=2))
    with torch.no_grad():  # larger weights than init, so a layout bug would show
        for p in policy.parameters():
            p.mul_(5.0)
    prompts = _ids(PROMPTS) * 4
    gen = policy.generate(prompts, 7, temperature=temperature, seed=5)
    logp, ent, old, mask = _recompute(policy, prompts, gen, temperature)
    assert len({len(t) for t in gen.tokens}) > 1  # ragged responses exercised
    torch.testing.assert_close(logp[mask], old[mask], atol=2e-5, rtol=1e-5)
    assert (ent >= 0).all()


def _generate_in_chunks(policy: Policy, prompts: list[list[int]], chunk: int, total: int,
                       seed: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Partial rollout as the rollouter does it: continue from prompt + tokens so far."""
    g = torch.Generator().manual_seed(seed)
    toks: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    while (live := [i for i, d in enumerate(done) if not d]):
        n = min(chunk, total - len(toks[live[0]]))
        out = policy.generate([prompts[i] + toks[i] for i in live], n, 1.0, generator=g)
        for i, t, lp, fin in zip(live, out.tokens, out.logprobs, out.finished, strict=True):
            toks[i] += t
            logps[i] += lp.tolist()
            done[i] = fin or len(toks[i]) >= total
    return toks, [np.array(lp, np.float32) for lp in logps]


def test_chunked_generation_logprobs_match() -> None:
    # partial_rollout generates a few tokens at a time; the joined log-probs must still be
    # what the trainer computes for prompt + whole response.
    torch.manual_seed(2)
    policy = TinyGPT(TinyConfig(d_model=32, n_layers=2, n_heads=2))
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(5.0)
    prompts = _ids(PROMPTS) * 3
    toks, logps = _generate_in_chunks(policy, prompts, chunk=2, total=7, seed=0)
    gen = Generation(toks, logps, [t[-1] == TOK.eos_id for t in toks])
    logp, _, old, mask = _recompute(policy, prompts, gen, 1.0)
    assert max(len(t) for t in toks) > 2  # really continued
    torch.testing.assert_close(logp[mask], old[mask], atol=2e-5, rtol=1e-5)


def test_weights_round_trip() -> None:
    a = TinyGPT()
    blob = a.state_bytes()
    assert blob == to_bytes(a.state_dict())  # deterministic bytes
    sd = from_bytes(blob)
    assert all(v.device.type == "cpu" for v in sd.values())
    torch.manual_seed(123)
    b = TinyGPT()
    assert b.state_bytes() != blob
    b.load_bytes(blob)
    prompts = _ids(PROMPTS)
    ga = a.generate(prompts, 5, 1.0, seed=9)
    gb = b.generate(prompts, 5, 1.0, seed=9)
    assert ga.tokens == gb.tokens
    for x, y in zip(ga.logprobs, gb.logprobs, strict=True):
        np.testing.assert_array_equal(x, y)
    assert b.head.weight.data_ptr() == b.tok_emb.weight.data_ptr()  # still tied
    buf = io.BytesIO()
    torch.save([torch.zeros(1)], buf)
    with pytest.raises(ValueError, match="state dict"):
        from_bytes(buf.getvalue())


def _mean_reward(policy: TinyGPT, texts: list[str], n: int, seed: int) -> float:
    prompts = _ids(texts)
    gen = policy.generate([p for p in prompts for _ in range(n)], 5, 1.0, seed=seed)
    answers = [t[:-1][::-1] for t in texts for _ in range(n)]
    return float(np.mean([digits_reward(TOK.decode(r), a)
                          for r, a in zip(gen.tokens, answers, strict=True)]))


def test_grpo_steps_increase_reward() -> None:
    torch.manual_seed(0)
    policy = TinyGPT(TinyConfig(d_model=32, n_layers=1, n_heads=2))
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    texts, n = ["123>", "4567>", "809>", "55>"], 16
    before = _mean_reward(policy, texts, 64, seed=1000)
    prompts = [p for p in _ids(texts) for _ in range(n)]
    answers = [t[:-1][::-1] for t in texts for _ in range(n)]
    for step in range(40):
        gen = policy.generate(prompts, 5, 1.0, seed=step)
        r = torch.tensor([digits_reward(TOK.decode(t), a)
                          for t, a in zip(gen.tokens, answers, strict=True)])
        adv = group_advantages(r.view(len(texts), n)).view(-1)
        b = build_batch(list(zip(prompts, gen.tokens, gen.logprobs, strict=True)))
        logp, _ = policy.logprobs_and_entropy(b.input_ids, b.attention_mask, b.response_len)
        loss, _ = policy_loss(logp, b.old_logprobs, adv, b.response_mask)[:2]
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _mean_reward(policy, texts, 64, seed=1000)
    assert before < 0.12
    assert after > before + 0.15, (before, after)
