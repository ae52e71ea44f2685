"""The engine boundary's contract (rollouter.engine.Engine), one suite run against every
engine: the built-in engine always, vLLM where it is installed (skipped with the reason
where it is not: ``make vllm``). Each engine is built the way the rollouter builds it
(:func:`rollouter.engine.build_engine` from a config's ``rollout.name``), once per module:
starting vLLM takes 30-100 s on a CPU.

What every engine guarantees: one response per prompt (tokens, their log-probs, whether an
eos id ended it), generated with the weights version it says it holds; ``load_state``
changes the version and the weights (the old weights back give the old responses); an eos
id ends a response right after it; greedy decoding repeats itself.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from policy import Generation
from rollouter.engine import Engine, PolicyEngine, build_engine, vllm_installed
from runconfig import load_config

# vLLM's imports (and torch's inductor, which it loads) raise deprecation warnings that are
# not ours to act on; pyproject makes warnings errors.
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

DEVICE = torch.device("cpu")
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 3, 3, 3], [1, 12, 4]]  # ids every model here has
NEW = 8
NO_EOS: list[int] = []  # no id ends a response: max_new_tokens does

ENGINES = [
    "hf",
    pytest.param("vllm", marks=[
        pytest.mark.vllm,
        pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make vllm)")]),
]


@dataclass
class Built:
    """An engine and two weight states it can load (``b``: ``a`` moved)."""

    engine: Engine
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]


def _moved(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state of a copy of ``module`` with every parameter moved by seeded noise (tied
    parameters stay tied: parameters() names each once)."""
    other = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return {k: v.detach().clone() for k, v in other.state_dict().items()}


def _builtin() -> Built:
    engine = build_engine(load_config(None, []), DEVICE, _no_warning)
    assert isinstance(engine, PolicyEngine)
    model = engine.policy
    assert isinstance(model, torch.nn.Module)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Built(engine, state, _moved(model))


def _vllm(root: Path) -> Built:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(  # attention heads 64 wide: vLLM's CPU attention
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # peakier logits than the init's: greedy has no near ties
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    model.save_pretrained(root)
    cfg = load_config(None, ["model.kind=hf", f"model.path={root}", "rollout.name=vllm",
                             "rollout.enforce_eager=true", "rollout.threads=1",
                             f"rollout.max_new_tokens={NEW}", "data.max_prompt_length=16"])
    engine = build_engine(cfg, DEVICE, _no_warning)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Built(engine, state, _moved(model))


def _no_warning(text: str) -> None:
    raise AssertionError(f"unexpected engine warning: {text}")


@pytest.fixture(scope="module", params=ENGINES)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Built]:
    torch.set_num_threads(1)
    out = _builtin() if request.param == "hf" else _vllm(tmp_path_factory.mktemp("qwen2"))
    try:
        yield out
    finally:
        out.engine.close()


def _greedy(engine: Engine, eos: list[int] = NO_EOS) -> Generation:
    return engine.generate(PROMPTS, NEW, temperature=0.0, eos_id=eos)


def test_generate_answers_every_prompt_with_the_version_it_holds(built: Built) -> None:
    engine = built.engine
    engine.load_state(built.a, 3)
    assert engine.version == 3
    steps = engine.steps
    out = engine.generate(PROMPTS, NEW, temperature=1.0, eos_id=NO_EOS,
                          generator=torch.Generator(device=DEVICE).manual_seed(0))
    assert len(out.tokens) == len(out.logprobs) == len(out.finished) == len(PROMPTS)
    for tokens, logprobs in zip(out.tokens, out.logprobs, strict=True):
        assert len(tokens) == len(logprobs) == NEW  # no eos: max_new_tokens ends it
        assert all(isinstance(t, int) for t in tokens)
        assert np.all(np.isfinite(logprobs)) and np.all(np.asarray(logprobs) <= 0.0)
    assert out.finished == [False] * len(PROMPTS)
    assert engine.steps > steps, "engine steps are the heartbeat's progress"
    assert engine.name in ("hf", "vllm") and isinstance(engine.eos_ids, tuple)


def test_load_state_changes_the_version_and_the_weights(built: Built) -> None:
    engine = built.engine
    engine.load_state(built.a, 1)
    first = _greedy(engine)
    engine.load_state(built.b, 2)
    assert engine.version == 2
    moved = _greedy(engine)
    assert moved.tokens != first.tokens
    engine.load_state(built.a, 3)
    assert engine.version == 3
    again = _greedy(engine)
    assert again.tokens == first.tokens
    for x, y in zip(again.logprobs, first.logprobs, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4)


def test_an_eos_id_ends_a_response_right_after_it(built: Built) -> None:
    engine = built.engine
    engine.load_state(built.a, 4)
    free = _greedy(engine)
    eos = free.tokens[0][2]  # the first response's third token
    cut = _greedy(engine, [eos])
    for full, tokens, finished in zip(free.tokens, cut.tokens, cut.finished, strict=True):
        if eos in full:
            assert tokens == full[:full.index(eos) + 1] and finished
        else:
            assert tokens == full and not finished
    assert cut.finished[0]


def test_greedy_decoding_repeats_itself(built: Built) -> None:
    engine = built.engine
    engine.load_state(built.b, 5)
    one, two = _greedy(engine), _greedy(engine)
    assert one.tokens == two.tokens
    for x, y in zip(one.logprobs, two.logprobs, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
