"""Files of a verl user's job, built locally: a tiny Hugging Face causal LM with its own BPE
tokenizer and chat template, verl-format parquet data and a reward file with verl's signature.

Nothing is downloaded: the tokenizer is trained here on the task's own text, the model is a
fresh seeded initialisation saved with ``save_pretrained``. The task reverses a digit string
asked for in a chat message (``Reverse 1234`` -> ``4321``), the default demo's digits task in a
verl user's clothes: a chat template, parquet records with ``data_source``,
``reward_model.ground_truth`` and ``extra_info``, a reward file.

Two shapes of model:

- ``qwen2`` (the tests' fixture): Qwen2's architecture, Qwen2's chat template and special
  tokens, a byte-level BPE split as Qwen2's (digits one by one);
- ``gpt2`` (the chat demo, ``build_demo``): GPT-2's architecture and a compact template of
  Phi-3's shape. A model this small has to learn from scratch which prompt position to copy;
  with learned absolute positions it does (validation reward 0.93 at step 100, in process),
  while the rotary Qwen2 stalled near 0.68-0.75 over 200-450 steps in every size and template
  tried (hidden 64/128, 2/4 layers, Qwen2's template or the compact one): measured with
  ``bench/sync_grpo_chat.py``, docs/benchmarks.md. Both have head_dim 32 (vLLM's CPU
  attention needs >= 32).

``python -m tasks.chatdemo DIR`` writes ``DIR/model``, ``DIR/train.parquet``,
``DIR/val.parquet`` and ``DIR/reward.py``.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any, Literal, NamedTuple

__all__ = [
    "DATA_SOURCE",
    "REWARD_FILE",
    "TEMPLATES",
    "build_demo",
    "build_model",
    "build_tokenizer",
    "records",
    "save_fresh_model",
    "write_parquet",
]

DATA_SOURCE = "rlbus/reverse_digits"


class ChatFormat(NamedTuple):
    """A chat template with its special tokens: ``eos`` ends an assistant turn."""

    template: str
    specials: tuple[str, ...]
    eos: str


TEMPLATES: dict[str, ChatFormat] = {
    # Qwen2's template, cut to what a single-turn chat needs.
    "qwen2": ChatFormat(
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
        " + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    # Phi-3's shape: <|role|>content<|end|>, then <|assistant|>; few tokens between the
    # question and the answer.
    "compact": ChatFormat(
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}",
        ("<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"), "<|end|>"),
}
# Qwen2's pre-tokenizer pattern: contractions, words, single digits, punctuation, spaces.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

REWARD_FILE = '''"""Reward of the chat demo, with verl's signature."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Share of positions right, the end of the answer counting as one more position
    (so a random policy earns a little and the stop is learned like a digit). The response
    is taken as it ends: whitespace after the answer is a wrong position, not an end."""
    response, answer = solution_str.lstrip() + "\\0", str(ground_truth) + "\\0"
    right = sum(a == b for a, b in zip(response, answer))
    score = right / max(len(response), len(answer))
    return {"score": score, "exact": float(score == 1.0)}
'''


def _corpus(n_digits: int, template: str) -> list[str]:
    """The task's text as the template writes it (roles are special tokens in ``compact``)."""
    rng = random.Random(0)
    lines = []
    for _ in range(200):
        digits = "".join(rng.choice("0123456789") for _ in range(n_digits))
        if template == "qwen2":
            lines.append(f"user\nReverse {digits}\nassistant\n{digits[::-1]}\nsystem\n")
        else:
            lines.append(f"Reverse {digits} {digits[::-1]}")
    return lines


def build_tokenizer(path: str | Path, n_digits: int = 4, template: str = "qwen2") -> Any:
    """A BPE tokenizer (digits one token each, as Qwen2's) trained on the task's text, with
    the special tokens and chat template of ``TEMPLATES[template]``; saved to ``path``."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    chat = TEMPLATES[template]
    # Byte-level BPE split as Qwen2's tokenizer splits (digits one by one), so that
    # AutoTokenizer, which rebuilds a qwen2 model's pre-tokenizer, reads it the same way. The
    # alphabet is the task's own characters only (no 256-byte base): about 50 ids keep a
    # random policy's first answers near the digits, as the default demo's char tokenizer.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Only the turn's end and <|endoftext|> are special (dropped from a decoded response):
    # the role markers are ordinary tokens, kept whole. A response that runs past its
    # answer into "<|assistant|>" then reads so and scores below 1, so the model learns to
    # end its turn; with the markers special, "4321<|assistant|>" decoded to "4321" and
    # scored 1.0, and the trained model never stopped (verl decodes rewards the same way).
    ends = [t for t in chat.specials if t in (chat.eos, "<|endoftext|>")]  # <|endoftext|> 0
    trainer = trainers.BpeTrainer(vocab_size=64, special_tokens=[*ends], show_progress=False)
    tok.train_from_iterator(_corpus(n_digits, template), trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t in chat.specials if t not in ends])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chat.eos,
                                   pad_token="<|endoftext|>")
    fast.chat_template = chat.template
    fast.save_pretrained(str(path))
    return fast


def _config(arch: str, vocab: int, hidden: int, layers: int, eos: int, pad: int) -> Any:
    from transformers import GPT2Config, Qwen2Config

    heads = hidden // 32
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                          n_positions=1024, bos_token_id=pad, eos_token_id=eos,
                          pad_token_id=pad)
    return Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=eos, pad_token_id=pad,
    )


def build_model(path: str | Path, *, arch: Literal["qwen2", "gpt2"] = "qwen2",
                hidden: int = 64, layers: int = 2, seed: int = 0, n_digits: int = 4) -> Path:
    """Tokenizer (Qwen2's template for ``qwen2``, the compact one for ``gpt2``) and a freshly
    initialised causal LM with head_dim 32 and a generation_config listing both EOS ids (the
    turn's end and ``<|endoftext|>``), saved to ``path``."""
    path = Path(path)
    tok = build_tokenizer(path, n_digits, "qwen2" if arch == "qwen2" else "compact")
    return save_fresh_model(path, tok, arch=arch, hidden=hidden, layers=layers, seed=seed)


def save_fresh_model(path: Path, tok: Any, *, arch: Literal["qwen2", "gpt2"], hidden: int,
                     layers: int, seed: int) -> Path:
    """A freshly initialised causal LM (seeded, head_dim 32) for the tokenizer ``tok``
    (its eos token ends a turn, ``<|endoftext|>`` pads), saved to ``path`` with a
    generation_config listing both end ids."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    eos, eot = tok.convert_tokens_to_ids([tok.eos_token, "<|endoftext|>"])
    config = _config(arch, len(tok), hidden, layers, eos, eot)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos, eot], pad_token_id=eot,
                                               bos_token_id=None)
    model.save_pretrained(str(path))
    return path


def records(n: int, split: str, seed: int, n_digits: int = 4) -> list[dict[str, Any]]:
    """verl-format records: ``prompt`` a list of chat messages, ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``."""
    rng = random.Random(f"chatdemo/{split}/{seed}")
    out = []
    for i in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(n_digits))
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"Reverse {digits}"}],
            "ability": "reverse",
            "reward_model": {"style": "rule", "ground_truth": digits[::-1]},
            "extra_info": {"split": split, "index": i},
        })
    return out


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Rows to a parquet file (pyarrow), as verl's preprocessing scripts write them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return Path(path)


def build_demo(root: str | Path, *, n_train: int = 2048, n_val: int = 64, seed: int = 0) -> Path:
    """Every file of the chat demo under ``root`` (skipped when already there)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model" / "config.json").is_file():
        build_model(root / "model", arch="gpt2", hidden=128, seed=seed)
    if not (root / "train.parquet").is_file():
        write_parquet(records(n_train, "train", 0), root / "train.parquet")
    if not (root / "val.parquet").is_file():
        write_parquet(records(n_val, "test", 1), root / "val.parquet")
    (root / "reward.py").write_text(REWARD_FILE)
    return root


if __name__ == "__main__":
    print(build_demo(sys.argv[1] if len(sys.argv) > 1 else "outputs/chatdemo"))
