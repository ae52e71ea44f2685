"""The chat demo's files, built locally: a tiny Qwen2-architecture model with its own BPE
tokenizer and chat template, verl-format parquet data and a reward file with verl's signature.

Nothing is downloaded: the tokenizer is trained here on the task's own text, the model is a
fresh seeded initialisation saved with ``save_pretrained``. The task reverses a digit string
asked for in a chat message (``Reverse 1234`` -> ``4321``), the digits task of the default
demo in a verl user's clothes: chat template, parquet records with ``data_source``,
``reward_model.ground_truth`` and ``extra_info``, a reward file. Tests build the same files.

``python -m tasks.chatdemo DIR`` writes ``DIR/model``, ``DIR/train.parquet``,
``DIR/val.parquet`` and ``DIR/reward.py``.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "DATA_SOURCE",
    "REWARD_FILE",
    "build_demo",
    "build_model",
    "build_tokenizer",
    "records",
    "write_parquet",
]

DATA_SOURCE = "rlbus/reverse_digits"

# Qwen2's template, cut to what a single-turn chat needs: no system prompt unless given,
# <|im_start|>role\ncontent<|im_end|>\n per message, the assistant header for generation.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer pattern: contractions, words, single digits, punctuation, spaces.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

REWARD_FILE = '''"""Reward of the chat demo, with verl's signature."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Share of positions right, the end of the answer counting as one more position
    (so a random policy earns a little and the stop is learned like a digit)."""
    response, answer = solution_str.strip() + "\\0", str(ground_truth) + "\\0"
    right = sum(a == b for a, b in zip(response, answer))
    score = right / max(len(response), len(answer))
    return {"score": score, "exact": float(score == 1.0)}
'''


def _corpus(n_digits: int) -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(200):
        digits = "".join(rng.choice("0123456789") for _ in range(n_digits))
        lines.append(f"user\nReverse {digits}\nassistant\n{digits[::-1]}\nsystem\n")
    return lines


def build_tokenizer(path: str | Path, n_digits: int = 4) -> Any:
    """A BPE tokenizer (digits one token each, as Qwen2's) trained on the task's
    text, with Qwen2's special tokens and chat template; saved to ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE split as Qwen2's tokenizer splits (its regex: digits one by one), so
    # that AutoTokenizer, which rebuilds a qwen2 model's pre-tokenizer, reads it the same way.
    # The alphabet is the task's own characters only (no 256-byte base): about 60 ids keep a
    # random policy's first answers near the digits, as the default demo's char tokenizer does.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=64, special_tokens=list(SPECIALS), show_progress=False,
    )
    tok.train_from_iterator(_corpus(n_digits), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_model(path: str | Path, *, hidden: int = 64, layers: int = 2, seed: int = 0,
                n_digits: int = 4) -> Path:
    """Tokenizer and a freshly initialised Qwen2 causal LM (head_dim 32: vLLM's CPU attention
    needs >= 32) with a generation_config listing both EOS ids, saved to ``path``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    tok = build_tokenizer(path, n_digits)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=im_end, pad_token_id=eot,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot,
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


def build_demo(root: str | Path, *, n_train: int = 2048, n_val: int = 64) -> Path:
    """Every file of the chat demo under ``root`` (skipped when already there)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model" / "config.json").is_file():
        build_model(root / "model")
    if not (root / "train.parquet").is_file():
        write_parquet(records(n_train, "train", 0), root / "train.parquet")
    if not (root / "val.parquet").is_file():
        write_parquet(records(n_val, "test", 1), root / "val.parquet")
    (root / "reward.py").write_text(REWARD_FILE)
    return root


if __name__ == "__main__":
    print(build_demo(sys.argv[1] if len(sys.argv) > 1 else "outputs/chatdemo"))
