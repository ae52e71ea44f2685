"""VllmEngine (rollout.name=vllm) against HFPolicy on the same tiny Qwen2, built and saved here.

The engine must be a drop-in for the HF decode loop: its rollout log-probs are the trainer's
recomputation (whole vocabulary, at the rollout temperature), new weights go in place and
take effect (the prefix cache of the old ones dropped), eos and max_new_tokens end responses,
a seeded generator reproduces a rollout, and close() leaves no engine process behind.
One engine serves the module: starting one takes 30-100 s on a CPU.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from policy import Generation
from rollouter.engine import EngineBroken
from rollouter.vllm_engine import VllmEngine, VllmOptions, options_from_config
from rollouter.vllm_options import max_model_len as _max_model_len
from runconfig.schema import Config, ModelConfig

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from policy.hf import HFPolicy  # noqa: E402
from trainer.grpo import build_batch  # noqa: E402

# vLLM's imports (and torch's inductor, which it loads) raise deprecation warnings that are
# not ours to act on; pyproject makes warnings errors.
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

EOS = 2
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 3, 3, 3, 3], [1], [1, 40, 41], [1, 77, 78, 79, 80]] * 2


def _needs_vllm() -> None:
    pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 whose attention heads are 64 wide (vLLM's CPU attention needs >= 32)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        # Tied like Qwen2's small models: the published state names the shared tensor twice
        # (embed_tokens and lm_head), which safetensors refuses unless written apart.
        bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # peakier logits than the init's, so a wrong layout shows up
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VllmEngine]:
    _needs_vllm()
    eng = VllmEngine.open(model_dir, VllmOptions(max_new_tokens=16, prompt_room=32, threads=1,
                                            kv_cache_gib=1))
    print(f"vLLM engine ready in {eng.startup_s:.1f} s")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> HFPolicy:
    torch.set_num_threads(1)
    return HFPolicy.from_pretrained(model_dir, device="cpu").eval()


def _recomputed(policy: HFPolicy, prompts: list[list[int]], gen: object,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the trainer's log-probs, the rollout's) of the response tokens, as the trainer batches
    them (left-padded prompts, right-padded responses)."""
    rows = list(zip(prompts, gen.tokens, gen.logprobs, strict=True))  # type: ignore[attr-defined]
    b = build_batch(rows, policy.pad_id)
    with torch.no_grad():
        logp, _ = policy.logprobs_and_entropy(b.input_ids, b.attention_mask, b.response_len,
                                              temperature=temperature)
    m = b.response_mask.bool()
    return logp[m], b.old_logprobs[m]


@pytest.mark.vllm
@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.7, 20, 0.9), (0.0, -1, 1.0)])
def test_rollout_logprobs_are_the_trainers(engine: VllmEngine, hf: HFPolicy, temperature: float,
                                           top_k: int, top_p: float) -> None:
    """Whole-vocabulary log softmax(logits / T) of each sampled token, with top-k / top-p on
    too (vLLM's own processed log-prob would be of the filtered distribution)."""
    g = torch.Generator().manual_seed(3)
    gen = engine.generate(PROMPTS, 12, temperature=temperature, eos_id=[EOS], top_p=top_p,
                          top_k=top_k, generator=g)
    assert [len(lp) for lp in gen.logprobs] == [len(t) for t in gen.tokens]
    assert all(lp.dtype == np.float32 for lp in gen.logprobs)
    new, old = _recomputed(hf, PROMPTS, gen, temperature)
    assert new.numel() > len(PROMPTS)
    torch.testing.assert_close(old, new, atol=1e-3, rtol=0)
    if top_k > 0:  # and the filter was applied: every sampled token is in its step's top k
        b = build_batch(list(zip(PROMPTS, gen.tokens, gen.logprobs, strict=True)), hf.pad_id)
        with torch.no_grad():
            logits, _ = hf._forward(b.input_ids, b.attention_mask, None, use_cache=False)
        pred = logits[:, -b.response_len - 1:-1].float()
        picked = pred.gather(-1, b.input_ids[:, -b.response_len:, None])[..., 0]
        kth = pred.topk(top_k, -1).values[..., -1]
        assert (picked >= kth - 1e-4)[b.response_mask.bool()].all()


@pytest.mark.vllm
def test_load_state_in_place(engine: VllmEngine, hf: HFPolicy, model_dir: Path) -> None:
    """New weights take effect without a restart (the prefix cache of the old ones dropped:
    the same prompts ran before), the version is what the worker reports, and loading the old
    weights back gives the old outputs."""
    before = engine.generate(PROMPTS, 10, temperature=0.0, eos_id=[])
    assert before.tokens == hf.generate(PROMPTS, 10, temperature=0.0, eos_id=[]).tokens
    other = HFPolicy.from_pretrained(model_dir, device="cpu").eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    engine.load_state(other.weights(), 5)
    assert engine.version == 5 and engine.worker_versions() == [5]
    after = engine.generate(PROMPTS, 10, temperature=0.0, eos_id=[])
    assert after.tokens == other.generate(PROMPTS, 10, temperature=0.0, eos_id=[]).tokens
    assert after.tokens != before.tokens
    sampled = engine.generate(PROMPTS, 10, temperature=1.0, eos_id=[EOS],
                              generator=torch.Generator().manual_seed(0))
    new, old = _recomputed(other, PROMPTS, sampled, 1.0)
    torch.testing.assert_close(old, new, atol=1e-3, rtol=0)

    # A state that does not fit is refused before the engine sees it (a bad tensor inside
    # vLLM's worker kills the engine core): the engine keeps its weights and its version.
    bad = dict(other.weights())
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="up_proj"):
        engine.load_state(bad, 6)
    del bad["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        engine.load_state(bad, 6)
    assert engine.version == 5
    assert engine.generate(PROMPTS, 10, temperature=0.0, eos_id=[]).tokens == after.tokens

    # bf16 tensors (rollout.weights_dtype=bf16) load too; then the original weights again.
    engine.load_state({k: v.to(torch.bfloat16) for k, v in other.weights().items()}, 6)
    assert engine.version == 6
    engine.load_state(hf.weights(), 7)
    assert engine.version == 7 and engine.worker_versions() == [7]
    assert engine.generate(PROMPTS, 10, temperature=0.0, eos_id=[]).tokens == before.tokens


@pytest.mark.vllm
def test_eos_and_max_new_tokens(engine: VllmEngine, hf: HFPolicy) -> None:
    """An eos id ends a response (finished, eos last); without one, max_new_tokens does."""
    steps = engine.steps
    capped = engine.generate(PROMPTS, 7, temperature=1.0, eos_id=[],
                             generator=torch.Generator().manual_seed(1))
    assert [len(t) for t in capped.tokens] == [7] * len(PROMPTS)
    assert engine.steps - steps >= 7  # progress: a prefill step, then one per token
    assert capped.finished == [False] * len(PROMPTS)
    greedy = engine.generate(PROMPTS, 6, temperature=0.0, eos_id=[])
    # Each prompt's own greedy third token as its eos: the response stops right there.
    for prompt, toks in zip(PROMPTS, greedy.tokens, strict=True):
        out = engine.generate([prompt], 6, temperature=0.0, eos_id=[toks[2]])
        cut = toks.index(toks[2]) + 1
        assert out.tokens == [toks[:cut]] and out.finished == [True]
    # eos_id None: the model's own (config and generation_config), as HFPolicy takes them.
    assert engine.eos_ids == hf.eos_ids == (EOS,)


@pytest.mark.vllm
def test_seeded_generate_is_reproducible(engine: VllmEngine) -> None:
    def run(seed: int) -> object:
        return engine.generate(PROMPTS, 12, temperature=1.0, eos_id=[EOS],
                               generator=torch.Generator().manual_seed(seed))

    a, b, c = run(11), run(11), run(12)
    assert a.tokens == b.tokens
    assert all(np.array_equal(x, y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
    assert a.tokens != c.tokens
    # Every prompt draws its own stream: equal prompts in one batch get different responses.
    twins = engine.generate([[1, 5, 6, 7]] * 4, 12, temperature=1.0, eos_id=[],
                            generator=torch.Generator().manual_seed(0))
    assert len({tuple(t) for t in twins.tokens}) > 1


def _stream(engine: VllmEngine, jobs: dict[str, list[int]], max_new: int, *, late: int = 0,
            abort_after: int = 0) -> dict[str, tuple[list[int], list[float], bool]]:
    """Responses to ``jobs`` (key -> prompt) streamed through the engine: the first ``late``
    keys are submitted only after two engine slices (while the others run); with
    ``abort_after``, every request is aborted after that many slices and resubmitted from
    its tokens so far (what the rollouter does at a sync with partial rollout)."""
    got: dict[str, tuple[list[int], list[float], bool]] = {k: ([], [], False) for k in jobs}
    g = torch.Generator().manual_seed(5)

    def submit(key: str) -> None:
        toks = got[key][0]
        engine.submit(key, jobs[key] + toks, max_new - len(toks), 1.0, [EOS], generator=g,
                      top_p=1.0, top_k=-1)

    def fold(deltas: list) -> None:
        for d in deltas:
            toks, logps, _ = got[d.key]
            assert len(d.tokens) == len(d.logprobs)
            got[d.key] = (toks + d.tokens, logps + d.logprobs, d.finished)

    keys = list(jobs)
    for key in keys[late:]:
        submit(key)
    slices = 0
    while engine.in_flight or slices < 2:
        fold(engine.advance(3))
        slices += 1
        if slices == 2:
            for key in keys[:late]:
                submit(key)
        if abort_after and slices == abort_after:
            fold(engine.abort())
            assert engine.in_flight == 0
            for key in keys:
                if not got[key][2]:
                    submit(key)
    return got


@pytest.mark.vllm
def test_streamed_requests_join_a_running_engine(engine: VllmEngine, hf: HFPolicy) -> None:
    """Continuous admission: requests submitted while others run get their responses, each
    token's log-prob the trainer's; a response ends at eos or its max_new_tokens; what a
    generate call runs meanwhile is not mixed in."""
    engine.load_state(hf.weights(), 9)
    jobs = {f"t{i}": p for i, p in enumerate(PROMPTS)}
    steps = engine.steps
    got = _stream(engine, jobs, 12, late=4)
    assert engine.steps - steps >= 12
    for toks, logps, done in got.values():
        assert 1 <= len(toks) <= 12 and len(logps) == len(toks)
        assert done and (toks[-1] == EOS or len(toks) == 12)
        assert EOS not in toks[:-1]
    gen = Generation([got[k][0] for k in jobs], [np.asarray(got[k][1], np.float32) for k in jobs],
                     [got[k][2] for k in jobs])
    new, old = _recomputed(hf, PROMPTS, gen, 1.0)
    torch.testing.assert_close(old, new, atol=1e-3, rtol=0)

    # A generate call while streamed requests run: each gets its own.
    engine.submit("s", PROMPTS[0], 8, 1.0, [], generator=None, top_p=1.0, top_k=-1)
    engine.advance(2)
    batch = engine.generate(PROMPTS[:3], 5, temperature=0.0, eos_id=[])
    assert batch.tokens == hf.generate(PROMPTS[:3], 5, temperature=0.0, eos_id=[]).tokens
    rest = []
    while engine.in_flight:
        rest += engine.advance(4)
    assert sum(len(d.tokens) for d in rest) + 0 <= 8 and rest[-1].finished


@pytest.mark.vllm
def test_cancelled_requests_end_alone_and_report_nothing(engine: VllmEngine,
                                                          hf: HFPolicy) -> None:
    """A superseded attempt's requests are cancelled one by one: they leave the engine at
    once and nothing more of them is reported; the others run to their end."""
    engine.load_state(hf.weights(), 11)
    for key, prompt in (("old/0", PROMPTS[0]), ("old/1", PROMPTS[1]), ("new/0", PROMPTS[2])):
        engine.submit(key, prompt, 12, 1.0, [], generator=None, top_p=1.0, top_k=-1)
    engine.advance(2)
    engine.cancel(["old/0", "old/1", "gone/0"])  # a key not running is passed over
    assert engine.in_flight == 1
    rest = []
    while engine.in_flight:
        rest += engine.advance(4)
    assert {d.key for d in rest} == {"new/0"} and rest[-1].finished


@pytest.mark.vllm
def test_aborted_requests_resume_from_their_tokens(engine: VllmEngine, hf: HFPolicy) -> None:
    """At a sync with partial rollout every streamed request is aborted and resubmitted
    with its tokens so far: the responses still run to eos or max_new_tokens, and every
    token's log-prob is the trainer's on the whole response."""
    engine.load_state(hf.weights(), 10)
    jobs = {f"a{i}": p for i, p in enumerate(PROMPTS)}
    got = _stream(engine, jobs, 12, abort_after=2)
    assert all(done for _, _, done in got.values())
    assert any(len(toks) > 6 for toks, _, _ in got.values())  # resumed past the abort
    gen = Generation([got[k][0] for k in jobs], [np.asarray(got[k][1], np.float32) for k in jobs],
                     [got[k][2] for k in jobs])
    new, old = _recomputed(hf, PROMPTS, gen, 1.0)
    torch.testing.assert_close(old, new, atol=1e-3, rtol=0)
    assert engine.abort() == [] and engine.in_flight == 0


@pytest.mark.vllm
def test_a_load_that_fails_inside_vllm_leaves_the_engine_broken_and_says_so(
    model_dir: Path, hf: HFPolicy,
) -> None:
    """vLLM 0.32's in-place reload cannot be undone when it fails midway (measured: every
    later generate fails on a meta tensor, and a good reload over it fails on the shapes):
    the engine says it is broken, on that load and on every later call, and holds no
    version. A state that does not fit is refused before vLLM sees it (the other tests)."""
    _needs_vllm()
    eng = VllmEngine.open(model_dir, VllmOptions(max_new_tokens=8, prompt_room=16, threads=1,
                                                kv_cache_gib=1))
    try:
        eng.load_state(hf.weights(), 1)
        assert eng.generate([[1, 5, 6]], 4, temperature=0.0, eos_id=[]).tokens
        bad = dict(hf.weights())
        bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
        eng._checked = lambda state: state  # type: ignore[method-assign]  # past the check
        with pytest.raises(EngineBroken, match="weights v2 and is left unusable"):
            eng.load_state(bad, 2)
        assert eng.version == -1
        for call in (lambda: eng.generate([[1, 5, 6]], 4),
                     lambda: eng.submit("k", [1, 5], 4, 1.0, None, generator=None, top_p=1.0,
                                        top_k=-1),
                     lambda: eng.advance(4), lambda: eng.load_state(hf.weights(), 3)):
            with pytest.raises(EngineBroken, match="v2"):
                call()
    finally:
        eng.close()


@pytest.mark.vllm
def test_the_engine_core_runs_in_this_process_and_close_frees_it(model_dir: Path) -> None:
    """With tensor_model_parallel_size 1 the engine core runs in the rollouter's process
    (own engine: the module's stays up): a killed rollouter leaves no engine process behind,
    and its profiler sees the engine's kernels."""
    _needs_vllm()
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    eng = VllmEngine.open(model_dir, VllmOptions(max_new_tokens=4, prompt_room=8, threads=1,
                                            kv_cache_gib=1))
    # multiprocessing's resource tracker outlives any one engine (one per interpreter)
    kids = [p for p in me.children(recursive=True) if p.pid not in before
            and "resource_tracker" not in " ".join(p.cmdline())]
    assert not kids, [p.cmdline() for p in kids]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert eng.generate([[1, 2, 3]], 3, temperature=0.0, eos_id=[]).tokens[0]
    assert any("attention" in e.name for e in prof.events()), "the engine's kernels"
    eng.close()
    assert eng._llm is None
    eng.close()  # idempotent


@pytest.mark.vllm
def test_seeded_prompts_wider_than_an_engine_step_generate(model_dir: Path) -> None:
    """20 seeded prompts of 13 tokens in steps of 64 tokens: split prefills would make a CPU
    vLLM rewind a CPU generator and fail every request; prompts prefill whole there."""
    _needs_vllm()
    eng = VllmEngine.open(model_dir, VllmOptions(max_new_tokens=5, prompt_room=16, threads=1,
                                            kv_cache_gib=1, max_num_batched_tokens=64,
                                            max_num_seqs=64))
    try:
        out = eng.generate([list(range(3, 16))] * 20, 5, temperature=1.0, eos_id=[],
                           generator=torch.Generator().manual_seed(1))
        assert [len(t) for t in out.tokens] == [5] * 20
    finally:
        eng.close()


def test_options_from_config(model_dir: Path) -> None:
    """The rollout.* keys reach the engine; the window is the prompt's room plus the
    response's, within the model's positions (128 here)."""
    cfg = Config(model=ModelConfig(kind="hf", path=str(model_dir), dtype="bf16"))
    path, opts = options_from_config(cfg)
    assert path == model_dir and opts.dtype == "bf16" and opts.seed == cfg.rollout.seed
    assert (opts.prompt_room, opts.max_new_tokens) == (cfg.data.max_prompt_length,
                                                       cfg.rollout.max_new_tokens)
    assert opts.threads == cfg.rollout.threads
    assert _max_model_len(opts, 128) == 128
    assert _max_model_len(opts, None) == opts.prompt_room + opts.max_new_tokens
    assert _max_model_len(VllmOptions(max_model_len=64), 128) == 64
    over = Config(model=ModelConfig(kind="hf", path=str(model_dir), override_config={
        "model_config": {"max_position_embeddings": 32, "attn_implementation": "sdpa"}}))
    assert options_from_config(over)[1].hf_overrides == {"max_position_embeddings": 32}


def test_config_errors(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys at fault are named: a tiny model, or no vllm installed."""
    with pytest.raises(ValueError, match=r"model\.kind"):
        VllmEngine(Config(model=ModelConfig(kind="tiny")))
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ValueError, match=r"rollout\.name.*make vllm"):
        VllmEngine(Config(model=ModelConfig(kind="hf", path=str(model_dir))))
