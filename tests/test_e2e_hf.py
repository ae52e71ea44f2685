"""The whole system on a Hugging Face causal LM loaded from a local directory (the test saves
a tiny randomly initialised GPT-2 with a char-level tokenizer; nothing is downloaded)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runschema.messages import RunFinished, Sample, StepFinished
from tests.procs import FAST, Procs, events_of

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
tokenizers = pytest.importorskip("tokenizers", reason="the hf extra is not installed")

CHARS = ">0123456789"


def _save_tiny_model(path: Path) -> int:
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tk.decoder = tokenizers.decoders.Fuse()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    ).save_pretrained(path)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=len(vocab), n_positions=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return len(vocab)


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_trainer_and_rollouter_on_a_local_hf_model(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    vocab = _save_tiny_model(tmp_path / "model")
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}", *FAST,
            "model.kind=hf", f"model.path={tmp_path / 'model'}",
            "trainer.total_training_steps=3"]
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
    assert all(math.isfinite(e.metrics["actor/grad_norm"]) for e in steps)
    samples = [m async for _, m in bus.read_all(run_keys.samples) if isinstance(m, Sample)]
    assert samples
    for s in samples:
        assert int(s.response_tokens.numpy().max(initial=0)) < vocab
        # The HF tokenizer encoded the prompt: bos, then one id per character.
        assert s.prompt_tokens.numpy()[0] == 1 and len(s.prompt_tokens) >= 4
