"""The agent demo's parts (rollout.multi_turn): a tokenizer whose chat template writes tools
and tool turns as Qwen2.5's does (hermes tool calls), and a tiny model on it; nothing is
downloaded.

The template is Qwen2.5's, cut to what a conversation with tools needs: the tools' schemas
in a system turn when ``tools=`` is given, the messages as ``<|im_start|>role ...<|im_end|>``,
consecutive ``tool`` messages gathered in one user turn of ``<tool_response>`` blocks, then
the assistant header. The tokenizer is byte-level BPE over every byte (any text encodes),
with ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and ``</tool_response>`` single
tokens, as in Qwen2.5's vocabulary.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

__all__ = ["TOOL_TAGS", "TOOL_TEMPLATE", "build_model", "build_tokenizer"]

TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\nYou may call these tools:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{%- endfor %}"
    "{{ '</tools>\\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_SPECIALS = ("<|endoftext|>", "<|im_end|>")  # special: dropped from a decoded response
_ROLES = ("<|im_start|>",)


def _corpus() -> list[str]:
    """Text in the shape of the demo's conversations, for the BPE merges."""
    rng = random.Random(0)
    lines = []
    for _ in range(300):
        a, b = rng.randrange(10**6), rng.randrange(10**6)
        lines.append(f'user\nWhat is {a} * {b}?\nassistant\n<tool_call>{{"name": "calculator", '
                     f'"arguments": {{"expression": "{a} * {b}"}}}}</tool_call>\nuser\n'
                     f"<tool_response>\n{a * b}\n</tool_response>\nassistant\n"
                     f"The answer is {a * b}.")
    return lines


def build_tokenizer(path: str | Path, vocab_size: int = 400) -> Any:
    """The byte-level BPE tokenizer with :data:`TOOL_TEMPLATE`, saved to ``path``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t in (*_ROLES, *TOOL_TAGS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = TOOL_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_model(path: str | Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """:func:`build_tokenizer` and a freshly initialised tiny Qwen2 on it, saved to ``path``
    (a generation_config listing both end ids)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    path = Path(path)
    tok = build_tokenizer(path)
    eos, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos, pad_token_id=eot)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos, eot], pad_token_id=eot,
                                               bos_token_id=None)
    model.save_pretrained(str(path))
    return path
