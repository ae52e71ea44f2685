"""The agent demo (rollout.multi_turn, ``make demo-agent``): a tokenizer whose chat template
writes tools and tool turns as Qwen2.5's does (hermes tool calls), a tiny model on it, and a
task that needs the tool; nothing is downloaded.

The template is Qwen2.5's, cut to what a conversation with tools needs: the tools' schemas
in a system turn when ``tools=`` is given, the messages as ``<|im_start|>role ...<|im_end|>``,
consecutive ``tool`` messages gathered in one user turn of ``<tool_response>`` blocks, then
the assistant header. The tokenizer is byte-level BPE over every byte (any text encodes),
with ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and ``</tool_response>`` single
tokens, as in Qwen2.5's vocabulary.

The task (:func:`records`): ``What is 482 * 917?``, a product of two 3-digit numbers, too
large for a model of this size to compute; the built-in calculator tool
(``agent.calculator.CalculatorTool``, :data:`TOOLS_FILE`) computes it. A good conversation is
one tool call, the tool's answer, then ``The answer is 441994.``; the reward
(:data:`REWARD_FILE`, verl's signature) is 1.0 for the exact product stated after a tool
response, partial credit per right digit otherwise. :func:`build_demo` writes the model after
a short supervised warm-up on such conversations (:func:`warm_up`, the loss on the
assistant's tokens only), so that the run starts from a model that knows the format but often
copies a number wrong, and RL has room to improve it.

``python -m tasks.agentdemo DIR`` writes ``DIR/model``, ``DIR/train.parquet``,
``DIR/val.parquet``, ``DIR/reward.py`` and ``DIR/tools.yaml``.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "DATA_SOURCE",
    "REWARD_FILE",
    "SCHEMA",
    "TOOLS_FILE",
    "TOOL_TAGS",
    "TOOL_TEMPLATE",
    "build_demo",
    "build_model",
    "build_tokenizer",
    "conversation",
    "records",
    "sample_accuracy",
    "warm_up",
    "write_parquet",
]

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

DATA_SOURCE = "rlbus/multiply_with_tools"

# The calculator's schema, described in few words: the prompt carries it (verl renders a
# tool_agent prompt with the tools' schemas), and a short prompt is a fast one here.
SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Arithmetic.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

TOOLS_FILE = (
    "# The agent demo's tools, in verl's tool config layout "
    "(actor_rollout_ref.rollout.multi_turn.tool_config_path).\n"
    "tools:\n"
    "  - class_name: agent.calculator.CalculatorTool\n"
    "    config: {type: native}\n"
    f"    tool_schema: {json.dumps(SCHEMA)}\n"
)

REWARD_FILE = '''"""Reward of the agent demo, with verl's signature: the product asked for,
stated in the final assistant answer (the text after the last tool response)."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the final answer states the exact product after a tool answered. Otherwise
    partial credit, at most 0.5: the share of digit positions of the first number in the
    final answer that are right (left to right, the number's end counting as one more
    position), so a random policy earns a little; a response with no tool response is the
    final answer as a whole, and is never worth more than 0.5."""
    at = solution_str.rfind("</tool_response>")
    used = at >= 0
    final = solution_str[at + len("</tool_response>"):] if used else solution_str
    final = re.sub(r"<tool_call>.*?(</tool_call>|$)", " ", final, flags=re.S)
    number = re.search(r"\\d+", final)
    stated = number.group(0) if number else ""
    exact = used and stated == str(ground_truth)
    answer, truth = stated + "\\0", str(ground_truth) + "\\0"
    right = sum(a == b for a, b in zip(answer, truth)) if stated else 0
    score = 1.0 if exact else 0.5 * right / max(len(answer), len(truth))
    return {"score": score, "exact": float(exact), "tool_answered": float(used)}
'''

ANSWER = "The answer is {}."


def _call(expression: str) -> str:
    args = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>{args}</tool_call>"


def _question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


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


def _demo_corpus() -> list[str]:
    """The demo's conversations as the template writes them (the system turn with the tools'
    schema included, so that its merges keep the prompt short)."""
    rng = random.Random(0)
    system = (f"system\nYou may call these tools:\n<tools>\n{json.dumps(SCHEMA)}\n</tools>\n"
              'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>\n')
    lines = []
    for _ in range(300):
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        lines.append(f"{system}user\n{_question(a, b)}\nassistant\n{_call(f'{a} * {b}')}\n"
                     f"user\n<tool_response>\n{a * b}\n</tool_response>\nassistant\n"
                     f"{ANSWER.format(a * b)}")
    return lines


def build_tokenizer(path: str | Path, vocab_size: int = 400, *,
                    split_digits: bool = False) -> Any:
    """The byte-level BPE tokenizer with :data:`TOOL_TEMPLATE`, saved to ``path``.
    ``split_digits``: digits one token each, split as Qwen2's tokenizer splits them (the
    demo's: a number is then copied digit by digit), trained on the demo's conversations."""
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

    tok = Tokenizer(models.BPE())
    if split_digits:
        from tasks.chatdemo import QWEN2_SPLIT

        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_demo_corpus() if split_digits else _corpus(), trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t in (*_ROLES, *TOOL_TAGS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = TOOL_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_model(path: str | Path, *, hidden: int = 64, layers: int = 2, seed: int = 0,
                arch: Literal["qwen2", "gpt2"] = "qwen2", split_digits: bool = False) -> Path:
    """:func:`build_tokenizer` and a freshly initialised tiny causal LM on it (Qwen2, or
    GPT-2's architecture: learned positions), saved to ``path`` (a generation_config listing
    both end ids)."""
    from tasks.chatdemo import save_fresh_model

    path = Path(path)
    tok = build_tokenizer(path, split_digits=split_digits)  # its eos token is <|im_end|>
    return save_fresh_model(path, tok, arch=arch, hidden=hidden, layers=layers, seed=seed)


# ----------------------------------------------------------------------------- the task


def _pair(rng: random.Random) -> tuple[int, int]:
    return rng.randrange(100, 1000), rng.randrange(100, 1000)


def records(n: int, split: str, seed: int) -> list[dict[str, Any]]:
    """verl-format records: ``prompt`` a list of chat messages, ``data_source``,
    ``reward_model.ground_truth`` (the product, a string), ``extra_info`` and ``agent_name``
    ``tool_agent`` (each generated as a conversation with the tools)."""
    rng = random.Random(f"agentdemo/{split}/{seed}")
    out = []
    for i in range(n):
        a, b = _pair(rng)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": _question(a, b)}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
            "agent_name": "tool_agent",
        })
    return out


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Rows to a parquet file (pyarrow), as verl's preprocessing scripts write them."""
    from tasks.chatdemo import write_parquet as write

    return write(rows, path)


class _Renderer:
    """The demo's conversations as token ids, each part encoded as the rollouter produces
    it: the prompt (template with the tools' schema), an assistant turn and its end token
    (generated), the tool turn (``agent.render``), the final answer and its end token."""

    def __init__(self, hf: Any) -> None:
        from agent.render import ToolTurnRenderer

        self.hf = hf
        self.eos = int(hf.convert_tokens_to_ids("<|im_end|>"))
        self.tool_turn = ToolTurnRenderer(hf, [SCHEMA])

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.hf.apply_chat_template(messages, tools=[SCHEMA], add_generation_prompt=True,
                                           tokenize=False)
        return self.encode(text)

    def tool(self, answer: str) -> list[int]:
        return self.tool_turn.tokens([answer], self.eos)


def conversation(hf: Any, a: int, b: int) -> tuple[list[int], list[int]]:
    """The demo's conversation for ``a * b`` (question, tool call, the calculator's answer,
    ``The answer is N.``) as the rollouter's tokens, and the warm-up's loss mask: 1 on the
    assistant's tokens (its turns and their end tokens), 0 on the prompt and the tool turn."""
    r = _Renderer(hf)
    parts = [(r.prompt([{"role": "user", "content": _question(a, b)}]), 0),
             ([*r.encode(_call(f"{a} * {b}")), r.eos], 1),
             (r.tool(str(a * b)), 0),
             ([*r.encode(ANSWER.format(a * b)), r.eos], 1)]
    return [t for ids, _ in parts for t in ids], [m for ids, m in parts for _ in ids]


def _device() -> Any:
    """CUDA when present, else the CPU (policy.resolve_device's 'auto')."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def warm_up(model_dir: str | Path, *, steps: int, batch: int = 16, lr: float = 2e-3,
            seed: int = 0, log: bool = True) -> Path:
    """Supervised next-token training of the model in ``model_dir`` on the demo's
    conversations (:func:`conversation`, fresh products each batch, none of them the
    records'), the loss on the assistant's tokens only; saved back in place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = _device()
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).to(device)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(f"agentdemo/warmup/{seed}")
    pad = int(hf.pad_token_id)
    began = time.monotonic()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(1, steps + 1):
            convs = [conversation(hf, *_pair(rng)) for _ in range(batch)]
            width = max(len(ids) for ids, _ in convs)
            ids = torch.full((batch, width), pad, dtype=torch.long)
            mask = torch.zeros((batch, width), dtype=torch.float32)
            for i, (toks, m) in enumerate(convs):
                ids[i, :len(toks)] = torch.tensor(toks)
                mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
            ids, mask = ids.to(device), mask.to(device)
            logits = model(input_ids=ids).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
            loss = (nll * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
            optim.zero_grad()
            loss.backward()
            optim.step()
            if log and (step % 50 == 0 or step == steps):
                print(f"warm-up step {step}/{steps}: loss {loss.item():.3f} "
                      f"({time.monotonic() - began:.0f} s)", flush=True)
    model.save_pretrained(str(model_dir))
    return Path(model_dir)


def _sample(model: Any, contexts: list[list[int]], max_new: int, temperature: float,
            eos: int, pad: int, gen: Any) -> list[list[int]]:
    """One assistant turn for each context, sampled (left-padded batch, no cache)."""
    import torch

    device = next(model.parameters()).device
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    att = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c)
        att[i, width - len(c):] = 1
    ids, att = ids.to(device), att.to(device)
    out: list[list[int]] = [[] for _ in contexts]
    done = [False] * len(contexts)
    for _ in range(max_new):
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, -1]
        probs = torch.softmax(logits.float() / temperature, -1)
        nxt = torch.multinomial(probs, 1, generator=gen)
        for i, t in enumerate(nxt[:, 0].tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = t == eos
        if all(done):
            break
        ids = torch.cat([ids, nxt], 1)
        att = torch.cat([att, torch.ones_like(nxt)], 1)
    return out


def _expression(name: str, arguments: str) -> str | None:
    """A calculator call's expression (None: another tool, or arguments without one)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    expr = args.get("expression") if isinstance(args, dict) and name == "calculator" else None
    return expr if isinstance(expr, str) else None


def sample_accuracy(model_dir: str | Path, *, n: int = 64, temperature: float = 1.0,
                    seed: int = 0, max_turn_tokens: int = 40) -> dict[str, float]:
    """How the model in ``model_dir`` does on ``n`` of the demo's questions sampled at
    ``temperature``, each a conversation of at most two assistant turns with the calculator
    run between (as ``make demo-agent`` runs them): the share with a well-formed calculator
    call, with the exact product stated after the tool's answer, and the mean reward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent.calculator import evaluate, render
    from agent.toolcall import parse_tool_calls

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).to(_device()).eval()
    r = _Renderer(hf)
    scope: dict[str, Any] = {}
    exec(REWARD_FILE, scope)
    rows = records(n, "test", seed + 1000)
    prompts = [r.prompt(row["prompt"]) for row in rows]
    gen = torch.Generator(device=_device()).manual_seed(seed)
    pad = int(hf.pad_token_id)
    with torch.no_grad():
        first = _sample(model, prompts, max_turn_tokens, temperature, r.eos, pad, gen)
        tool_turns: list[list[int]] = []
        for turn in first:
            _, calls, _ = parse_tool_calls(hf.decode([t for t in turn if t != r.eos]), "hermes")
            expr = _expression(calls[0].name, calls[0].arguments) if calls else None
            try:
                answer = render(evaluate(expr)) if expr is not None else None
            except ValueError as e:
                answer = f"Error: {e}"
            tool_turns.append(r.tool(answer) if answer is not None else [])
        going = [i for i, t in enumerate(tool_turns) if t and first[i][-1:] == [r.eos]]
        second = _sample(model, [prompts[i] + first[i] + tool_turns[i] for i in going],
                         max_turn_tokens, temperature, r.eos, pad, gen) if going else []
    responses = [first[i] + tool_turns[i] for i in range(n)]
    for i, turn in zip(going, second, strict=True):
        responses[i] = responses[i] + turn
    scores = [scope["compute_score"](DATA_SOURCE, hf.decode(resp, skip_special_tokens=True),
                                     row["reward_model"]["ground_truth"])
              for resp, row in zip(responses, rows, strict=True)]
    return {"called": len(going) / n,
            "exact": sum(s["exact"] for s in scores) / n,
            "reward": sum(s["score"] for s in scores) / n}


def build_demo(root: str | Path, *, n_train: int = 2048, n_val: int = 64, seed: int = 0,
               warmup_steps: int = 220, hidden: int = 128, layers: int = 2,
               arch: Literal["qwen2", "gpt2"] = "qwen2") -> Path:
    """Every file of the agent demo under ``root``, each skipped when already there: the
    model (:func:`build_model`, then :func:`warm_up` for ``warmup_steps``), train and
    validation parquet, ``reward.py`` and ``tools.yaml``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    if not (model / "config.json").is_file():
        tmp = root / "model.partial"
        build_model(tmp, hidden=hidden, layers=layers, seed=seed, arch=arch,
                    split_digits=True)
        if warmup_steps:
            warm_up(tmp, steps=warmup_steps, seed=seed)
        tmp.rename(model)
    if not (root / "train.parquet").is_file():
        write_parquet(records(n_train, "train", seed), root / "train.parquet")
    if not (root / "val.parquet").is_file():
        write_parquet(records(n_val, "test", seed + 1), root / "val.parquet")
    if not (root / "reward.py").is_file():
        (root / "reward.py").write_text(REWARD_FILE)
    if not (root / "tools.yaml").is_file():
        (root / "tools.yaml").write_text(TOOLS_FILE)
    return root


def _main(argv: Sequence[str]) -> None:
    root = Path(argv[0]) if argv else Path("outputs/agentdemo")
    print(build_demo(root))


if __name__ == "__main__":
    _main(sys.argv[1:])
