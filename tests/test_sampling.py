"""Sampling: top_k / top_p (vLLM's meaning), a set of EOS ids, and the recorded log-probs of
the full distribution (what the trainer recomputes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from policy import build_policy, decode_loop, eos_set, filter_logits
from policy.model import TinyConfig, TinyGPT
from policy.tokenizer import CharTokenizer
from trainer.grpo import build_batch

TOK = CharTokenizer()
PROMPTS = [TOK.encode(t, bos=True) for t in ["12>", "98765>", "4>", "3141>"]]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


def _peaky(seed: int = 3) -> TinyGPT:
    torch.manual_seed(seed)
    policy = TinyGPT(TinyConfig(d_model=32, n_layers=2, n_heads=2))
    with torch.no_grad():  # larger weights than init: distinct, confident logits
        for p in policy.parameters():
            p.mul_(5.0)
    return policy


def test_filter_logits_keeps_top_k_and_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = torch.isfinite
    assert kept(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False, False]]
    assert kept(filter_logits(logits, top_k=-1)).all() and kept(filter_logits(logits, 0)).all()
    assert kept(filter_logits(logits, top_k=5)).all()
    # The smallest set holding top_p of the mass: 0.5 < 0.6 <= 0.5 + 0.2.
    assert kept(filter_logits(logits, top_p=0.6)).tolist() == [[True, True, False, False, False]]
    assert kept(filter_logits(logits, top_p=0.5)).tolist() == [[True, False, False, False, False]]
    assert kept(filter_logits(logits, top_p=0.71)).tolist() == [[True, True, True, False, False]]
    assert kept(filter_logits(logits, top_p=1e-9)).sum() == 1  # the top token always stays
    assert kept(filter_logits(logits, top_p=1.0)).all()
    # top-k first, then top-p over what is left (vLLM's order): of {0.5, 0.2} renormalised
    # (0.714, 0.286), top_p 0.75 keeps both.
    assert kept(filter_logits(logits, top_k=2, top_p=0.75)).sum() == 2
    # Shuffled vocabulary: the same tokens, wherever they are.
    perm = torch.tensor([3, 0, 4, 1, 2])
    out = filter_logits(logits[:, perm], top_p=0.6)
    assert kept(out).tolist() == [[False, True, False, True, False]]


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}])
def test_top_k_one_and_a_tiny_top_p_are_greedy(kw: dict[str, float]) -> None:
    policy = _peaky()
    prompts = PROMPTS * 3
    greedy = policy.generate(prompts, 8, temperature=0.0)
    sampled = policy.generate(prompts, 8, temperature=1.3, seed=7, **kw)  # type: ignore[arg-type]
    assert sampled.tokens == greedy.tokens
    free = policy.generate(prompts, 8, temperature=1.3, seed=7)
    assert free.tokens != greedy.tokens  # the filter is what made it greedy


def test_filters_off_give_the_unfiltered_draws() -> None:
    policy = _peaky()
    a = policy.generate(PROMPTS * 3, 8, temperature=1.0, seed=4)
    b = policy.generate(PROMPTS * 3, 8, temperature=1.0, seed=4, top_p=1.0, top_k=-1)
    c = policy.generate(PROMPTS * 3, 8, temperature=1.0, seed=4, top_k=0)
    assert a.tokens == b.tokens == c.tokens


def test_top_k_draws_only_the_k_likeliest() -> None:
    vocab = 10
    logits = torch.linspace(0.0, 2.0, vocab)  # token 9 likeliest, then 8, 7 ...

    def step(ids: torch.Tensor, mask: torch.Tensor, cache: int | None
             ) -> tuple[torch.Tensor, int]:
        return logits.expand(ids.shape[0], ids.shape[1], vocab).clone(), 0

    gen = decode_loop(step, [[1]] * 64, 6, 1.0, None, 0, CPU,
                      torch.Generator().manual_seed(0), top_k=3)
    drawn = {t for toks in gen.tokens for t in toks}
    assert drawn == {7, 8, 9}


def test_logprobs_are_of_the_full_distribution() -> None:
    vocab, temperature = 6, 0.8
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -3.0])

    def step(ids: torch.Tensor, mask: torch.Tensor, cache: int | None
             ) -> tuple[torch.Tensor, int]:
        return logits.expand(ids.shape[0], ids.shape[1], vocab).clone(), 0

    gen = decode_loop(step, [[1]] * 16, 4, temperature, None, 0, CPU,
                      torch.Generator().manual_seed(1), top_k=2)
    full = torch.log_softmax(logits / temperature, -1)
    for toks, lps in zip(gen.tokens, gen.logprobs, strict=True):
        assert set(toks) <= {0, 1}
        np.testing.assert_allclose(lps, full[toks].numpy(), rtol=1e-6)
    # ... not of the filtered (renormalised) one
    assert not np.allclose(gen.logprobs[0][0], torch.log_softmax(logits[:2] / temperature,
                                                                 -1)[gen.tokens[0][0]])


def test_filtered_rollout_logprobs_match_the_trainers_recomputation() -> None:
    policy = _peaky()
    prompts = PROMPTS * 4
    gen = policy.generate(prompts, 7, temperature=0.9, seed=2, top_k=3, top_p=0.8)
    b = build_batch(list(zip(prompts, gen.tokens, gen.logprobs, strict=True)), policy.pad_id)
    with torch.no_grad():
        logp, _ = policy.logprobs_and_entropy(b.input_ids, b.attention_mask, b.response_len,
                                              0.9)
    m = b.response_mask.bool()
    torch.testing.assert_close(logp[m], b.old_logprobs[m], atol=2e-5, rtol=1e-5)


def test_a_set_of_eos_ids_stops_at_either() -> None:
    # Row 0 emits 5 then eos A, row 1 eos B at once, row 2 only 5s.
    A, B, vocab = 2, 3, 8

    def step(ids: torch.Tensor, mask: torch.Tensor, cache: int | None
             ) -> tuple[torch.Tensor, int]:
        t = 0 if cache is None else cache + 1
        logits = torch.full((ids.shape[0], ids.shape[1], vocab), -1e9)
        logits[:, -1, 5] = 0.0
        if t >= 1:
            logits[0, -1, :] = -1e9
            logits[0, -1, A] = 0.0
        logits[1, -1, :] = -1e9
        logits[1, -1, B] = 0.0
        return logits, t

    gen = decode_loop(step, [[1], [1], [1]], 4, 1.0, [A, B], 0, CPU)
    assert gen.tokens == [[5, A], [B], [5, 5, 5, 5]]
    assert gen.finished == [True, True, False]
    one = decode_loop(step, [[1], [1], [1]], 4, 1.0, A, 0, CPU)  # an int still works
    assert one.tokens[0] == [5, A] and one.tokens[1] == [B, B, B, B]
    assert one.finished == [True, False, False]
    assert eos_set(2, [3, 2], None, (4,)) == (2, 3, 4)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tasks.chatdemo import build_model

    return build_model(tmp_path_factory.mktemp("chat") / "model")


def test_hf_policy_ends_at_every_generation_config_eos(chat_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model), local_files_only=True)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    policy = build_policy({"kind": "hf", "path": str(chat_model)}, "cpu")
    assert policy.eos_id == im_end and policy.eos_ids == (im_end, eot)
    # A zero final norm makes every logit 0: greedy takes the first id, <|endoftext|>, which
    # only generation_config lists (config.eos_token_id is <|im_end|>).
    assert eot == 0 and policy.model.config.eos_token_id == im_end
    with torch.no_grad():
        policy.model.model.norm.weight.zero_()
    prompt = tok.encode("Reverse 1234", add_special_tokens=False)
    gen = policy.generate([prompt] * 4, 6, temperature=0.0)
    assert gen.tokens == [[eot]] * 4 and all(gen.finished)
    # Sampling (uniform now) also ends at either id; nothing follows one.
    gen = policy.generate([prompt] * 64, 200, temperature=1.0, seed=0, top_k=50, top_p=0.9)
    for toks, done in zip(gen.tokens, gen.finished, strict=True):
        assert not set(toks[:-1]) & {im_end, eot}
        assert done == (toks[-1] in (im_end, eot))
    assert any(gen.finished)
