"""Tasks: digits prompts and reward, jsonl prompts, reward function loading."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from policy.tokenizer import CharTokenizer
from tasks import Prompt, PromptSource, build_prompt_source
from tasks.digits import DigitsPrompts, digits_reward
from tasks.jsonl import JsonlPrompts, load_jsonl
from tasks.reward import RewardFnError, load_reward_fn


def test_digits_reward_values() -> None:
    # Position-wise match where stopping counts as one more position, over the longer length.
    assert digits_reward("321", "321") == 1.0
    assert digits_reward("301", "321") == pytest.approx(3 / 4)  # 2 digits + the stop
    assert digits_reward("999", "321") == pytest.approx(1 / 4)  # only the stop is right
    assert digits_reward("32", "321") == pytest.approx(2 / 4)  # stopped early
    assert digits_reward("3215", "321") == pytest.approx(3 / 5)  # did not stop
    assert digits_reward("321000000", "321") == pytest.approx(3 / 10)
    assert digits_reward("", "321") == 0.0
    assert digits_reward("", "") == 1.0 and digits_reward("1", "") == 0.0
    # A random-looking response earns a little, never a lot.
    assert 0.0 < digits_reward("3\ufffd\ufffd\ufffd", "321") < 0.5


def test_decode_keeps_non_characters_visible() -> None:
    # pad/bos inside a response must not shorten it (that would fake a correct stop).
    tok = CharTokenizer()
    ids = [*tok.encode("32"), tok.pad_id, tok.bos_id]
    assert len(tok.decode(ids)) == 4
    assert digits_reward(tok.decode(ids), "32") < digits_reward("32", "32")


def test_digits_prompts_deterministic() -> None:
    src1 = DigitsPrompts(seed=7, min_digits=2, max_digits=5)
    src2 = DigitsPrompts(seed=7, min_digits=2, max_digits=5)
    xs = [src1.next() for _ in range(200)]
    assert xs == [src2.next() for _ in range(200)]
    assert [p.prompt_id for p in xs[:3]] == ["p0", "p1", "p2"]
    assert xs[42] == src1.get(42)
    other = [DigitsPrompts(seed=8, min_digits=2, max_digits=5).get(i) for i in range(200)]
    assert other != xs
    for p in xs:
        digits = p.prompt[:-1]
        assert p.prompt.endswith(">") and digits.isdigit() and 2 <= len(digits) <= 5
        assert p.answer == digits[::-1]
    assert {len(p.answer) for p in xs} == {2, 3, 4, 5}
    assert isinstance(src1, PromptSource)
    src1.index = 42  # resume
    assert src1.next() == xs[42]


def test_digits_prompts_encode_with_char_tokenizer() -> None:
    tok = CharTokenizer()
    p = DigitsPrompts(seed=0).get(0)
    ids = tok.encode(p.prompt, bos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.sep_id
    assert tok.decode([*tok.encode(p.answer, eos=True), 5, 6]) == p.answer  # stops at eos


def test_digits_prompts_bad_bounds() -> None:
    with pytest.raises(ValueError):
        DigitsPrompts(min_digits=4, max_digits=3)


def test_tokenizer_rejects_unknown_char() -> None:
    with pytest.raises(ValueError, match="not in the tokenizer"):
        CharTokenizer().encode("12a")


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_loading_and_cycling(tmp_path: Path) -> None:
    f = _write_jsonl(tmp_path / "p.jsonl",
                     [{"prompt": "12>", "answer": "21"}, "", {"prompt": "7>", "answer": "7"}])
    assert load_jsonl(f) == [("12>", "21"), ("7>", "7")]
    src = JsonlPrompts(f)
    got = [src.next() for _ in range(3)]
    assert got == [Prompt("p0", "12>", "21"), Prompt("p1", "7>", "7"), Prompt("p2", "12>", "21")]
    shuffled = JsonlPrompts(f, seed=3)
    assert sorted(shuffled.get(i).prompt for i in range(2)) == ["12>", "7>"]
    assert [shuffled.get(i) for i in range(6)] == [JsonlPrompts(f, seed=3).get(i)
                                                   for i in range(6)]
    built = build_prompt_source({"kind": "jsonl", "path": str(f)})
    assert built.next() == got[0]


def test_jsonl_errors(tmp_path: Path) -> None:
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1>", "answer": "1"}, "{oops"])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_jsonl(bad)
    missing = _write_jsonl(tmp_path / "m.jsonl", [{"prompt": "1>"}])
    with pytest.raises(ValueError, match=r"m.jsonl:1: expected"):
        load_jsonl(missing)
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_jsonl(empty)


def test_build_prompt_source() -> None:
    src = build_prompt_source({"kind": "digits", "min_digits": 5, "max_digits": 5}, seed=1)
    assert len(src.next().answer) == 5
    assert build_prompt_source(None, seed=1).get(3) == DigitsPrompts(seed=1).get(3)
    with pytest.raises(ValueError, match="unknown task kind"):
        build_prompt_source({"kind": "chess"})
    with pytest.raises(ValueError, match="path"):
        build_prompt_source({"kind": "jsonl"})


def test_load_reward_fn_good_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_reward_fn(None) is digits_reward
    assert load_reward_fn("") is digits_reward
    assert load_reward_fn("digits") is digits_reward
    assert load_reward_fn("tasks.digits:digits_reward") is digits_reward
    assert load_reward_fn("tasks.digits.digits_reward") is digits_reward
    (tmp_path / "my_rewards_mod.py").write_text(
        "def exact(response, answer):\n    return float(response == answer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        fn = load_reward_fn("my_rewards_mod:exact")
        assert fn("ab", "ab") == 1.0 and fn("a", "ab") == 0.0
    finally:
        sys.modules.pop("my_rewards_mod", None)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("tasks.digits:nope", "has no attribute 'nope'"),
        ("tasks.digits.DigitsPrompts.nope", "cannot import|no attribute"),
        ("tasks.digits:__name__", "not callable"),
        ("justaname", "expected 'module:function'"),
        ("mod:", "expected 'module:function'"),
    ],
)
def test_load_reward_fn_bad_paths(spec: str, match: str) -> None:
    with pytest.raises(RewardFnError, match=match):
        load_reward_fn(spec)
    assert issubclass(RewardFnError, ValueError)
