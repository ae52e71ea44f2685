"""verl's rewards (tasks.rewards) and the rollouter's reward pool (rollouter.scoring).

Reward files are written to tmp_path and loaded the way verl loads
``custom_reward_function.path``; the pool runs real worker processes."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bus import Bus, RunKeys
from rollouter.scoring import MAX_CHUNK, RewardPool, ScoreItem, chunk_size
from runconfig import ConfigError, load_config
from runconfig.schema import (
    Config,
    CustomRewardConfig,
    OverlongBufferConfig,
    RewardModelConfig,
    RolloutConfig,
)
from runschema.messages import Sample, StepFinished, WarningRaised
from tasks.rewards import (
    Scorer,
    UnknownDataSource,
    builtin_score,
    check_scorers,
    extra_metrics,
    gsm8k_extract,
    gsm8k_score,
    has_builtin,
    interpret,
    last_boxed,
    load_custom_reward,
    math_equivalent,
    math_score,
    overlong_penalty,
    spec_from_config,
)
from tests.procs import FAST, Procs, events_of, run_cli

VERL_ECHO = '''
import json

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Echoes what verl's reward managers pass, as the extra info of a dict return."""
    with open(kwargs.pop("log"), "a") as f:
        f.write(json.dumps({"data_source": data_source, "solution_str": solution_str,
                            "ground_truth": ground_truth, "extra_info": extra_info,
                            "kwargs": kwargs}) + "\\n")
    return {"score": float(solution_str == ground_truth), "pred": solution_str,
            "length": len(solution_str), "flag": True}
'''

PICKY = '''
import os
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "slow":
        time.sleep(60)
    if solution_str == "bad":
        raise RuntimeError("verifier crashed on " + ground_truth)
    if solution_str == "die":
        os._exit(3)
    if solution_str == "nap":
        time.sleep(0.2)
    return float(solution_str == ground_truth)
'''


def _file(tmp_path: Path, text: str, name: str = "reward.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _cfg(path: str | None = None, *, kwargs: dict[str, Any] | None = None,
         manager: str = "naive", buffer: OverlongBufferConfig | None = None,
         max_new_tokens: int = 20, workers: int = 1, timeout_s: float = 30.0,
         reward_kwargs: dict[str, Any] | None = None) -> Config:
    return Config(
        custom_reward_function=CustomRewardConfig(path=path, reward_kwargs=kwargs or {}),
        reward_model=RewardModelConfig(reward_manager=manager,  # type: ignore[arg-type]
                                       overlong_buffer=buffer or OverlongBufferConfig(),
                                       reward_kwargs=reward_kwargs or {}),
        rollout=RolloutConfig(max_new_tokens=max_new_tokens, reward_workers=workers,
                              reward_timeout_s=timeout_s),
    )


def _item(solution: str, truth: Any = "7", data_source: str = "my/source",
          extra: dict[str, Any] | None = None, length: int = 3) -> tuple[Any, ...]:
    return (data_source, solution, truth, extra, length)


# --------------------------------------------------------------------------- return forms


def test_return_forms() -> None:
    assert interpret(1) == (1.0, {"acc": 1.0})
    assert interpret(0.25) == (0.25, {"acc": 0.25})
    assert interpret(True) == (1.0, {"acc": 1.0})
    reward, extra = interpret({"score": 0.5, "acc": 1, "pred": "42", "ok": False,
                               "nan": float("nan")})
    assert reward == 0.5
    assert extra == {"acc": 1.0, "ok": 0.0}  # text and non-finite values are left out
    with pytest.raises(TypeError, match="'score'"):
        interpret({"acc": 1.0})
    with pytest.raises(TypeError, match="expected a number"):
        interpret("1.0")
    with pytest.raises(TypeError, match="expected a number"):
        interpret(None)
    with pytest.raises(ValueError, match="finite"):
        interpret(float("inf"))


def test_extra_info_metrics() -> None:
    assert extra_metrics([{"acc": 1.0, "overlong": 1.0}, {"acc": 0.0}, {}]) == {
        "reward_extra/acc/mean": 0.5, "reward_extra/overlong/mean": 1.0}
    assert extra_metrics([]) == {}


def test_custom_reward_gets_verl_arguments_and_reward_kwargs(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    path = _file(tmp_path, VERL_ECHO)
    scorer = Scorer(spec_from_config(_cfg(path, kwargs={"log": str(log), "bonus": 2})))
    truth = {"target": "7"}  # ground_truth reaches the function as stored
    reward, extra = scorer(_item("7", truth, "openai/gsm8k", {"split": "train", "index": 4}))
    assert (reward, extra) == (0.0, {"length": 1.0, "flag": 1.0})
    call = json.loads(log.read_text())
    assert call["data_source"] == "openai/gsm8k"  # a custom function wins over the built-in
    assert call["solution_str"] == "7"
    assert call["ground_truth"] == truth
    assert call["extra_info"]["split"] == "train" and call["extra_info"]["index"] == 4
    assert call["kwargs"] == {"bonus": 2}
    reward, _ = scorer(_item("7", "7"))
    assert reward == 1.0


def test_reward_kwargs_win_over_the_call(tmp_path: Path) -> None:
    """verl merges custom_reward_function.reward_kwargs over the call's own keywords."""
    path = _file(tmp_path, """
        def score_it(data_source, solution_str, ground_truth, extra_info=None):
            return float(ground_truth == "forced")
    """)
    cfg = load_config(None, [f"custom_reward_function.path={path}",
                             "custom_reward_function.name=score_it",
                             "+custom_reward_function.reward_kwargs.ground_truth=forced"])
    assert Scorer(spec_from_config(cfg))(_item("x", "7")) == (1.0, {"acc": 1.0})


def test_the_chat_demos_reward_file(tmp_path: Path) -> None:
    from tasks.chatdemo import DATA_SOURCE, REWARD_FILE

    cfg = _cfg(_file(tmp_path, REWARD_FILE))
    check_scorers(cfg, [DATA_SOURCE])
    with pytest.raises(ConfigError, match=DATA_SOURCE):
        check_scorers(_cfg(), [DATA_SOURCE])  # no reward file: refused, as verl would
    scorer = Scorer(spec_from_config(cfg))
    assert scorer(_item(" 4321", "4321", DATA_SOURCE)) == (1.0, {"exact": 1.0})
    assert scorer(_item("43", "4321", DATA_SOURCE)) == (0.4, {"exact": 0.0})
    # What follows the answer counts: a turn that does not end there is not exact (a
    # trailing space, or a role marker, which the demo's tokenizer keeps in the text).
    assert scorer(_item("4321 ", "4321", DATA_SOURCE)) == (4 / 6, {"exact": 0.0})
    assert scorer(_item("4321<|assistant|>", "4321", DATA_SOURCE))[0] < 1.0


def test_async_custom_reward(tmp_path: Path) -> None:
    path = _file(tmp_path, """
        async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.75
    """)
    assert Scorer(spec_from_config(_cfg(path)))(_item("x")) == (0.75, {"acc": 0.75})


@pytest.mark.parametrize(("text", "name", "match"), [
    (None, "compute_score", "no such file"),
    ("def compute_score(:\n", "compute_score", "syntax error at line 1"),
    ("raise ImportError('no sympy')\n", "compute_score", "ImportError: no sympy"),
    ("def other(): pass\n", "compute_score", "has no function 'compute_score'"),
    ("compute_score = 3\n", "compute_score", "not a function"),
])
def test_bad_reward_files_are_config_errors(tmp_path: Path, text: str | None, name: str,
                                            match: str) -> None:
    path = str(tmp_path / "r.py") if text is None else _file(tmp_path, text, "r.py")
    with pytest.raises(ConfigError, match=match) as err:
        load_custom_reward(path, name)
    assert err.value.key == "custom_reward_function.path"
    assert path in str(err.value)
    with pytest.raises(ConfigError, match=match):  # the pool refuses it before any process
        RewardPool(_cfg(path))


# verl's own verl/utils/reward_score/gsm8k.py: a scorer, not a compute_score for a reward
# manager (no data_source): given as custom_reward_function.path, every call would raise.
VERL_GSM8K = '''
def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    return 0.0
'''


@pytest.mark.parametrize(("text", "kwargs", "problem"), [
    (VERL_GSM8K, {}, "cannot take the keyword 'data_source'"),
    ("def compute_score(data_source, solution_str, ground_truth, extra_info, /):\n  pass\n",
     {}, "takes 'data_source' only by position"),
    ("def compute_score(data_source, solution_str, ground_truth, extra_info, strict):\n"
     "  pass\n", {}, "needs the argument 'strict', which verl does not pass"),
    ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n  pass\n",
     {"log": "x"}, "cannot take the keyword 'log'"),  # a reward_kwargs key it has no place for
])
def test_a_function_verl_cannot_call_is_refused_naming_it_and_the_keyword(
    tmp_path: Path, text: str, kwargs: dict[str, Any], problem: str
) -> None:
    path = _file(tmp_path, text, "r.py")
    with pytest.raises(ConfigError) as err:
        spec_from_config(_cfg(path, kwargs=kwargs))
    assert err.value.key == "custom_reward_function.path"
    assert f"{path}:compute_score {problem}: verl calls it as compute_score(data_source=..., " \
           "solution_str=..., ground_truth=..., extra_info=...)" in str(err.value)
    with pytest.raises(ConfigError, match=problem):  # the pool refuses it before any process
        RewardPool(_cfg(path, kwargs=kwargs))


@pytest.mark.parametrize("signature", [
    "data_source, solution_str, ground_truth, extra_info=None",
    "**kwargs",
    "data_source, *, solution_str, ground_truth, extra_info, **rest",
    "solution_str, ground_truth, **kwargs",
])
def test_functions_verl_can_call_are_taken(tmp_path: Path, signature: str) -> None:
    path = _file(tmp_path, f"def compute_score({signature}):\n    return 1.0\n", "r.py")
    assert spec_from_config(_cfg(path)).custom_path == path


def test_a_failed_score_makes_a_sample_that_carries_its_error() -> None:
    """verl's rewards: a failed score is still a sample (reward 0) with its error, the
    timeout marked; rlbus's own task.reward_fn fails its ticket instead (no sample)."""
    from rollouter.answers import Seq, to_samples
    from rollouter.scoring import Score
    from runschema.messages import PromptTicket, decode, encode

    def ticket(tid: str, source: str) -> PromptTicket:
        return PromptTicket(ticket_id=tid, prompt_id="p", prompt="", answer="7", n=3,
                            min_version=0, data_source=source)

    verl, own = ticket("t0", "my/source"), ticket("t1", "")
    seqs = [Seq(ticket=t, index=i, prompt=[1], tokens=[2]) for t in (verl, own)
            for i in range(3)]
    timeout = "reward function timed out after 30 s (rollout.reward_timeout_s)"
    scores = [Score(1.0, {}, 0.1, False), Score(0.0, {}, 0.1, True, "ValueError: no"),
              Score(0.0, {}, 30.0, True, timeout, True), Score(1.0, {}, 0.1, False),
              Score(0.0, {}, 0.1, True, "RuntimeError: down"), Score(1.0, {}, 0.1, False)]
    samples, failed = to_samples(seqs, scores, {"t0": [1], "t1": [1]}, gen_s=1.0, rank=0,
                                 eos_id=None, fails_ticket=lambda t: not t.data_source)
    assert failed == {"t1": "reward function failed: RuntimeError: down"}
    assert [(s.reward_error, s.reward_timed_out) for s in samples["t0"]] == [
        ("", False), ("ValueError: no", False), (timeout, True)]
    # A sample written before these fields existed reads as scored.
    old = msgspec.msgpack.decode(encode(samples["t0"][0]))
    del old["reward_error"], old["reward_timed_out"]
    again = decode(msgspec.msgpack.encode(old))
    assert isinstance(again, Sample) and (again.reward_error, again.reward_timed_out) == ("", False)


def test_rlbus_reward_fn_and_digits_still_score_tickets_without_data_source() -> None:
    scorer = Scorer(spec_from_config(_cfg()))
    assert scorer(_item("321", "321", data_source="")) == (1.0, {})
    assert scorer(_item("32", "321", data_source="")) == (0.5, {})
    cfg = load_config(None, ["task.reward_fn=rewards_for_tests:always_fail"])
    with pytest.raises(RuntimeError, match="verifier is down"):
        Scorer(spec_from_config(cfg))(_item("1", "1", data_source=""))
    with pytest.raises(ConfigError, match="no_such_module_x") as err:
        spec_from_config(load_config(None, ["task.reward_fn=no_such_module_x:f"]))
    assert err.value.key == "task.reward_fn"


# --------------------------------------------------------------------------- built-in scorers


def test_gsm8k_scorer() -> None:
    assert gsm8k_extract("so 3 + 4 = 7\n#### 7") == "7"
    assert gsm8k_extract("#### 1,234") == "1234"
    assert gsm8k_extract("#### 5 then #### -6") == "-6"  # the last one
    assert gsm8k_extract("the answer is 7") is None  # strict needs ####
    assert gsm8k_extract("the answer is 7.", "flexible") == "7."
    assert gsm8k_extract("7 then . and", "flexible") == "7"
    assert gsm8k_extract("#### 7" + "x" * 300) is None  # only the last 300 characters
    assert gsm8k_score("#### 72", "72") == 1.0
    assert gsm8k_score("#### 71", "72") == 0.0  # verl's format_score default
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("72", "72") == 0.0
    assert builtin_score("openai/gsm8k", "so #### 18", "18") == 1.0


def test_math_scorer() -> None:
    assert last_boxed(r"so \boxed{\frac{1}{2}} and then \boxed{3}") == "3"
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert last_boxed(r"is \boxed 5$ done") == "5"
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed(r"\fbox{5}") is None
    assert last_boxed("no answer") is None
    assert math_equivalent(r"\dfrac{1}{2}", "0.5")
    assert math_equivalent(r"\frac12", r"\frac{1}{2}")
    assert math_equivalent("1/2", r"\frac{1}{2}")
    assert math_equivalent(r"\left( 3, 4 \right)", "(3,4)")
    assert math_equivalent(r"90^\circ", "90")
    assert math_equivalent(r"5 \text{ cm}", "5")
    assert math_equivalent("x = 5", "5")
    assert math_equivalent(r"\sqrt2", r"\sqrt{2}")
    assert math_equivalent(r"10\%", "10")
    assert math_equivalent(".5", "0.5")
    assert not math_equivalent("3", "4")
    assert math_equivalent(r"\sqrt", r"\sqrt")  # not normalisable: compared as written
    assert math_score(r"The area is $\boxed{\dfrac{3}{4}}$.", r"\frac34") == 1.0
    assert math_score(r"The area is $\boxed{1}$.", "2") == 0.0
    assert math_score("no box 3/4", "3/4") == 0.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                   "HuggingFaceH4/MATH-500"):
        assert has_builtin(source)
        assert builtin_score(source, r"\boxed{12}", "12") == 1.0
    assert has_builtin("openai/gsm8k") and not has_builtin("my/source")
    with pytest.raises(UnknownDataSource, match="my/source"):
        builtin_score("my/source", "x", "y")


def test_builtin_scorers_by_data_source_in_a_scorer() -> None:
    scorer = Scorer(spec_from_config(_cfg()))
    assert scorer(_item("#### 7", "7", "openai/gsm8k")) == (1.0, {"acc": 1.0})
    assert scorer(_item(r"\boxed{7}", "7", "lighteval/MATH")) == (1.0, {"acc": 1.0})
    with pytest.raises(UnknownDataSource):
        scorer(_item("7", "7", "my/source"))


def test_check_scorers_refuses_data_sources_without_a_scorer(tmp_path: Path) -> None:
    check_scorers(_cfg(), ["openai/gsm8k", "lighteval/MATH", ""])
    with pytest.raises(ConfigError, match="'my/source'") as err:
        check_scorers(_cfg(), ["openai/gsm8k", "my/source"])
    assert err.value.key == "custom_reward_function.path"
    check_scorers(_cfg(_file(tmp_path, PICKY)), ["my/source"])  # a reward file scores it


# --------------------------------------------------------------------------- dapo


def test_dapo_overlong_penalty() -> None:
    # max 20 tokens, buffer 4, factor 1: no penalty up to 16 tokens, -1 at 20.
    assert [overlong_penalty(n, 20, 4, 1.0) for n in (10, 16, 17, 18, 20)] == [
        0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(18, 20, 4, 0.5) == -0.25
    buffer = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0, log=True)
    scorer = Scorer(spec_from_config(_cfg(manager="dapo", buffer=buffer)))
    assert scorer(_item("#### 7", "7", "openai/gsm8k", length=18)) == (
        0.5, {"acc": 1.0, "overlong_reward": -0.5, "overlong": 1.0})
    assert scorer(_item("#### 7", "7", "openai/gsm8k", length=12)) == (
        1.0, {"acc": 1.0, "overlong_reward": 0.0, "overlong": 0.0})
    quiet = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    scorer = Scorer(spec_from_config(_cfg(manager="dapo", buffer=quiet)))
    assert scorer(_item("#### 7", "7", "openai/gsm8k", length=20)) == (0.0, {"acc": 1.0})
    # verl's newer spelling: reward_kwargs.max_resp_len / overlong_buffer_cfg
    scorer = Scorer(spec_from_config(_cfg(manager="dapo", reward_kwargs={
        "max_resp_len": 40, "overlong_buffer_cfg": {"enable": True, "len": 10,
                                                    "penalty_factor": 2.0}})))
    assert scorer(_item("#### 7", "7", "openai/gsm8k", length=35))[0] == 0.0
    # ... as a verl line writes them, one dotted key at a time
    cfg = load_config(None, ["reward_model.reward_manager=dapo",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1",
                             "rollout.max_new_tokens=20"])
    scorer = Scorer(spec_from_config(cfg))
    assert scorer(_item("#### 7", "7", "openai/gsm8k", length=19))[0] == 0.25


@pytest.mark.parametrize(("manager", "buffer", "kwargs", "key"), [
    ("naive", OverlongBufferConfig(enable=True, len=4), {}, "reward_model.overlong_buffer.enable"),
    ("dapo", OverlongBufferConfig(enable=True, len=0), {}, "reward_model.overlong_buffer.len"),
    ("dapo", OverlongBufferConfig(enable=True, len=21), {}, "reward_model.overlong_buffer.len"),
    ("naive", None, {"num_examine": 1}, "reward_model.reward_kwargs"),
    ("dapo", None, {"overlong_buffer_cfg": {"enable": True, "len": "x"}},
     "reward_model.reward_kwargs"),
    ("dapo", None, {"overlong_buffer_cfg": {"enable": "yes", "len": 4}},
     "reward_model.reward_kwargs"),
    ("dapo", None, {"overlong_buffer_cfg": 4}, "reward_model.reward_kwargs"),
])
def test_bad_reward_manager_settings(manager: str, buffer: OverlongBufferConfig | None,
                                     kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        spec_from_config(_cfg(manager=manager, buffer=buffer, reward_kwargs=kwargs))
    assert err.value.key == key


# --------------------------------------------------------------------------- the pool


def _items(*solutions: str, truth: str = "7") -> list[ScoreItem]:
    return [ScoreItem(data_source="my/source", solution_str=s, ground_truth=truth,
                      extra_info={"i": i}, response_len=len(s)) for i, s in enumerate(solutions)]


@pytest.mark.asyncio
async def test_a_timed_out_scorer_scores_0_and_the_pool_keeps_serving(tmp_path: Path) -> None:
    pool = RewardPool(_cfg(_file(tmp_path, PICKY), timeout_s=2.0))
    try:
        scores = await pool.score(_items("7", "slow", "8", "7"))
        assert [(s.reward, s.failed) for s in scores] == [
            (1.0, False), (0.0, True), (0.0, False), (1.0, False)]
        assert "timed out after 2 s" in scores[1].error
        assert (pool.timeouts, pool.failures) == (1, 0)
        warning = pool.take_warning()
        assert warning is not None and "reward/timeout_count" in warning
        again = await pool.score(_items("7", "7"))  # the hung worker was replaced
        assert [s.reward for s in again] == [1.0, 1.0]
        assert all(s.seconds >= 0 for s in again)
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_fast_samples_go_in_chunks_and_a_chunk_at_fault_is_scored_one_by_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a batch timed the scorer fast, 64 samples take 2 round trips, not 64; a chunk
    holding a hung, a raising and a dying sample is scored again one at a time: each of
    those fails for itself only, every other sample scores."""
    pool = RewardPool(_cfg(_file(tmp_path, PICKY), timeout_s=2.0))
    worker = pool._workers[0]
    calls: list[int] = []
    call = worker.call

    def counted(item: Any, timeout_s: float) -> Any:
        calls.append(len(item) if isinstance(item, list) else 1)
        return call(item, timeout_s)

    monkeypatch.setattr(worker, "call", counted)
    try:
        assert [s.reward for s in await pool.score(_items("7", "8"))] == [1.0, 0.0]
        assert calls == [1, 1]  # a scorer not yet timed: one sample a call
        calls.clear()
        scores = await pool.score(_items(*["7"] * 64))
        assert calls == [32, 32] and [s.reward for s in scores] == [1.0] * 64
        calls.clear()
        batch = ["7", "slow", "8", "bad", "die", *["7"] * 11]
        scores = await pool.score(_items(*batch))
        assert calls[0] == 8  # the chunk at fault, then its 8 samples one by one
        assert calls[1:9] == [1] * 8
        assert [(s.reward, s.failed) for s in scores] == [
            (1.0, False), (0.0, True), (0.0, False), (0.0, True), (0.0, True),
            *[(1.0, False)] * 11]
        assert scores[1].timed_out and "timed out after 2 s" in scores[1].error
        assert scores[3].error == "RuntimeError: verifier crashed on 7"
        assert "died (exit code 3)" in scores[4].error
        assert (pool.timeouts, pool.failures) == (1, 2) and pool.scored == 82
    finally:
        pool.close()


def test_chunk_size() -> None:
    assert chunk_size(None, 30.0, 64, 1) == 1  # not yet timed
    assert chunk_size(1e-5, 30.0, 64, 1) == MAX_CHUNK
    assert chunk_size(1e-5, 30.0, 64, 4) == 8  # every worker gets two chunks
    assert chunk_size(0.3, 30.0, 64, 1) == 5  # 5 x 0.3 s = 5% of 30 s
    assert chunk_size(30.0, 30.0, 64, 1) == 1  # a batch that timed out
    assert chunk_size(1e-5, 30.0, 1, 2) == 1


@pytest.mark.asyncio
async def test_a_raising_scorer_is_counted_and_warned_once(tmp_path: Path) -> None:
    pool = RewardPool(_cfg(_file(tmp_path, PICKY), workers=2))
    try:
        scores = await pool.score(_items("bad", "7", "bad", "die", "7"))
        assert [s.failed for s in scores] == [True, False, True, True, False]
        assert [s.reward for s in scores] == [0.0, 1.0, 0.0, 0.0, 1.0]
        assert scores[0].error == "RuntimeError: verifier crashed on 7"
        assert "died (exit code 3)" in scores[3].error
        assert (pool.failures, pool.timeouts) == (3, 0)
        warning = pool.take_warning()
        assert warning is not None
        assert "Traceback" in warning and "verifier crashed on 7" in warning
        assert "my/source" in warning
        assert pool.take_warning() is None
        await pool.score(_items("bad"))
        assert pool.failures == 4 and pool.take_warning() is None  # warned once
        assert not pool.fails_ticket("my/source")
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_a_worker_that_cannot_load_fails_its_batch_and_is_retried(tmp_path: Path) -> None:
    """The file went bad after the run started and the worker died: each remaining sample
    of the batch fails at once with the load error (one start tried, not one per sample);
    the next batch starts afresh."""
    path = _file(tmp_path, PICKY)
    pool = RewardPool(_cfg(path))
    try:
        assert [s.reward for s in await pool.score(_items("7"))] == [1.0]
        _file(tmp_path, "raise RuntimeError('disk full')\n")
        died = await pool.score(_items("die"))
        assert died[0].failed and "died (exit code 3)" in died[0].error
        scores = await pool.score(_items("7", "7", "7"))
        assert all(s.failed and "could not load" in s.error for s in scores)
        assert pool.failures == 4
        warning = pool.take_warning()
        assert warning is not None and "exit code 3" in warning
        _file(tmp_path, PICKY)
        assert [s.reward for s in await pool.score(_items("7"))] == [1.0]
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_rlbus_reward_fn_failures_fail_their_ticket_unwarned() -> None:
    pool = RewardPool(load_config(None, ["task.reward_fn=rewards_for_tests:fail_on_nines"]))
    try:
        items = [ScoreItem(data_source="", solution_str="1", ground_truth=a, extra_info=None,
                           response_len=1) for a in ("123", "987")]
        scores = await pool.score(items)
        assert not scores[0].failed and scores[1].failed
        assert "verifier crashed" in scores[1].error
        assert pool.fails_ticket("") and pool.take_warning() is None
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_slow_scoring_does_not_block_the_event_loop(tmp_path: Path) -> None:
    """0.2 s a sample on 2 workers: the loop ticks all along (a scorer on the loop would
    let no tick through until the batch is done)."""
    pool = RewardPool(_cfg(_file(tmp_path, PICKY), workers=2))
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    try:
        await pool.score(_items("7", "7"))  # workers started
        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        scores = await pool.score(_items(*["nap"] * 8, truth="nap"))
        during = ticks
        ticker.cancel()
        assert [s.reward for s in scores] == [1.0] * 8
        assert all(s.seconds >= 0.2 for s in scores)
        # 8 x 0.2 s on 2 workers is 0.8 s of 10 ms ticks; a scorer on the loop lets none by.
        assert during >= 8, during
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_schema_keys_win_over_verls_table(tmp_path: Path) -> None:
    path = _file(tmp_path, PICKY)
    cfg = load_config(None, [f"custom_reward_function.path={path}",
                             "rollout.reward_workers=1"])
    assert cfg.custom_reward_function.path == path
    pool = RewardPool(cfg)
    try:
        assert [s.reward for s in await pool.score(_items("7", "6"))] == [1.0, 0.0]
    finally:
        pool.close()


# --------------------------------------------------------------------------- a real run

RUN_REWARD = '''
import json
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None, log=None):
    with open(log, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "data_source": data_source,
                            "ground_truth": ground_truth, "extra_info": extra_info}) + "\\n")
    if ground_truth.startswith("9"):
        raise ValueError("cannot score " + ground_truth)
    right = sum(a == b for a, b in zip(solution_str, ground_truth))
    return {"score": right / len(ground_truth), "exact": float(solution_str == ground_truth)}
'''


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_run_trains_on_the_users_reward_file(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    """The user's file is what scores every sample (in the reward workers, not the
    rollouter), its extra keys reach the samples, and its failures score 0 with one
    warning, counted in each step's metrics (rlbus inspect shows them): with
    reward.max_failure_ratio=1 the run finishes."""
    log = tmp_path / "calls.jsonl"
    path = _file(tmp_path, RUN_REWARD)
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}", *FAST,
            "run.retention=all", "trainer.total_training_steps=2",
            f"custom_reward_function.path={path}", "reward.max_failure_ratio=1",
            f"+custom_reward_function.reward_kwargs.log={log}", "rollout.reward_workers=2"]
    procs = Procs(tmp_path / "logs")
    try:
        rollouter_pid = procs.spawn("rollouter0", "rollouter", *args).pid
        procs.spawn("trainer", "trainer", *args)
        assert procs.wait("trainer", 180) == 0, procs.log("trainer")
        assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    finally:
        procs.kill_all()
    events = await events_of(bus, run_keys.events)
    assert len([e for e in events if isinstance(e, StepFinished)]) == 2
    samples = [m async for _, m in bus.read_all(run_keys.samples) if isinstance(m, Sample)]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) >= len(samples) > 0
    assert {c["data_source"] for c in calls} == {""}
    assert all(c["extra_info"] == {"num_turns": None, "rollout_reward_scores": {}}
               for c in calls)
    assert len({c["pid"] for c in calls} - {rollouter_pid}) >= 1
    assert all("reward_extra/exact/mean" in e.metrics for e in events
               if isinstance(e, StepFinished))
    scored = [s for s in samples if "exact" in s.reward_extra]
    assert scored and all(s.reward_s > 0 for s in scored)
    # The digits prompts of task.seed 0 are fixed: the 4th answer is 9935, so some fail.
    failed = [s for s in samples if not s.reward_extra]
    assert failed and all(s.reward == 0.0 and s.reward_s >= 0 for s in failed)
    assert all(s.reward_error.startswith("ValueError: cannot score 9") for s in failed)
    assert not any(s.reward_error or s.reward_timed_out for s in scored)
    res = run_cli("inspect", "--run", run_id, "--json", f"redis.url={redis_url}")
    assert res.returncode == 0, res.stderr
    steps = [r["metrics"] for r in map(json.loads, res.stdout.splitlines())
             if r["type"] == "StepFinished"]
    assert len(steps) == 2 and all(m["reward/timeout_count"] == 0.0 for m in steps)
    assert sum(m["reward/failed_count"] for m in steps) > 0
    warnings = [e for e in events if isinstance(e, WarningRaised) and e.code == "reward_failed"]
    assert len(warnings) == 1, warnings
    assert "ValueError: cannot score 9" in warnings[0].message
    assert "Traceback" in warnings[0].message


@pytest.mark.e2e
def test_rlbus_up_stops_at_the_first_failed_reward(tmp_path: Path) -> None:
    """reward.max_failure_ratio=0 (the default, verl's behaviour): a reward function that
    raises stops the run before any step is recorded; rlbus up exits non-zero with the
    function and its error in one line."""
    path = _file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            raise ValueError("verifier is down")
        """)
    out = tmp_path / "out"
    up = run_cli("up", f"run.output_dir={out}", "run.id=down", *FAST,
                 "trainer.total_training_steps=3", "trainer.logger=[console]",
                 f"custom_reward_function.path={path}", timeout_s=240)
    assert up.returncode != 0, up.stdout + up.stderr
    said = f"reward function {path}:compute_score failed: ValueError: verifier is down ("
    assert any(line.startswith(f"trainer0 failed: {said}") and line.endswith(
        "reward.max_failure_ratio=0)") for line in up.stderr.splitlines()), up.stderr
    assert "step    1/3" not in up.stdout, up.stdout  # no step finished


@pytest.mark.procs
@pytest.mark.parametrize(("args", "named"), [
    (["custom_reward_function.path=/no/such/reward.py"], "/no/such/reward.py"),
    (["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true"],
     "reward_model.overlong_buffer.len"),
])
def test_rlbus_up_refuses_a_bad_reward_before_anything_starts(
    tmp_path: Path, args: list[str], named: str
) -> None:
    res = run_cli("up", f"run.output_dir={tmp_path}", *args, timeout_s=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert named in res.stderr
    assert not any(tmp_path.iterdir())  # no run directory, no Redis: nothing started


@pytest.mark.asyncio
async def test_the_rollouters_pulse_carries_the_reward_counters(
    redis_url: str, bus: Bus, run_id: str, tmp_path: Path
) -> None:
    from rollouter.app import Rollouter

    cfg = load_config(overrides=[f"redis.url={redis_url}", f"run.id={run_id}",
                                 f"run.output_dir={tmp_path}",
                                 f"custom_reward_function.path={_file(tmp_path, PICKY)}"])
    r = Rollouter(cfg, bus)
    await r.setup()
    try:
        rewards = r.context.scorer.rewards
        assert rewards is not None
        await rewards.score(_items("bad", "7", "bad"))
        metrics = r.heartbeat().metrics
        assert metrics["reward/failed_count"] == 2.0
        assert metrics["reward/timeout_count"] == 0.0
    finally:
        await r.teardown()
        r.worker.shutdown()


@pytest.mark.procs
def test_rlbus_up_refuses_a_function_verl_cannot_call_in_one_line(tmp_path: Path) -> None:
    """verl's gsm8k.py as the reward function: exit 2 before anything starts, one line
    naming the file, the function and the keyword it cannot take."""
    path = _file(tmp_path, VERL_GSM8K, "gsm8k.py")
    out = tmp_path / "out"
    out.mkdir()
    res = run_cli("up", f"run.output_dir={out}", f"custom_reward_function.path={path}",
                  timeout_s=120)
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = [x for x in res.stderr.splitlines() if path in x]
    assert f"{path}:compute_score cannot take the keyword 'data_source'" in line
    assert "Traceback" not in res.stderr
    assert not any(out.iterdir())  # no run directory, no Redis: nothing started


@pytest.mark.procs
@pytest.mark.parametrize(("text", "said"), [
    ("def compute_score(:\n", ": syntax error at line 1"),
    (VERL_GSM8K, ":compute_score cannot take the keyword 'data_source'"),
])
def test_a_rollouter_with_a_bad_reward_file_exits_2(
    redis_url: str, run_id: str, tmp_path: Path, text: str, said: str
) -> None:
    import subprocess
    import sys

    path = _file(tmp_path, text)
    res = subprocess.run(
        [sys.executable, "-m", "rollouter", f"redis.url={redis_url}", f"run.id={run_id}",
         f"run.output_dir={tmp_path}", f"custom_reward_function.path={path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"{path}{said}" in res.stderr
    assert "Traceback" not in res.stderr


SLOW_REWARD = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.3)
    return float(solution_str == ground_truth)
'''


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_slow_reward_does_not_starve_the_heartbeat(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    """issue 18: a 0.3 s a sample scorer, one worker: a batch of 16 responses scores for
    4.8 s, longer than heartbeat.timeout_s=3, yet the rollouter stays alive (on its loop,
    the trainer would have declared it gone) and the run finishes."""
    path = _file(tmp_path, SLOW_REWARD)
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}", *FAST,
            "run.retention=all", "trainer.total_training_steps=2", "heartbeat.timeout_s=3",
            f"custom_reward_function.path={path}", "rollout.reward_workers=1"]
    procs = Procs(tmp_path / "logs")
    try:
        procs.spawn("rollouter0", "rollouter", *args)
        procs.spawn("trainer", "trainer", *args)
        assert procs.wait("trainer", 300) == 0, procs.log("trainer")
        assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    finally:
        procs.kill_all()
    samples = [m async for _, m in bus.read_all(run_keys.samples) if isinstance(m, Sample)]
    assert samples and all(s.reward_s >= 0.3 for s in samples)
    batch_s = 16 * 0.3
    assert batch_s > 3


def test_the_reward_module_imports_without_torch() -> None:
    """Reward workers import only tasks.rewards: no torch, so they start in a moment."""
    import subprocess
    import sys

    code = "import sys, tasks.rewards; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parents[1])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
