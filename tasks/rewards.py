"""verl's rewards: a user's reward function file, the built-in scorers chosen by
``data_source``, and the ``naive`` / ``dapo`` reward managers around them.

Pure Python (no torch): the rollouter's reward worker processes import only this module, so
they start in a fraction of a second. :class:`Scorer` is what a worker runs per sample;
``rollouter.scoring.RewardPool`` runs the workers off the event loop.

Which scorer a sample gets:

* ``custom_reward_function.path`` set: that function, for every sample, called as verl calls
  it (keywords ``data_source``, ``solution_str``, ``ground_truth``, ``extra_info``, then
  ``custom_reward_function.reward_kwargs``, which win over the call's own keywords);
* else a sample with a ``data_source``: the built-in scorer of that source (GSM8K-style
  ``#### N``, MATH-style ``\\boxed{}``), as verl's ``default_compute_score``;
* else (rlbus's own tasks, whose tickets carry no data source): ``task.reward_fn``
  (``module:function`` called ``(response, answer)``), the digits reward by default.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runconfig import ConfigError
from tasks.reward import RewardFnError, load_reward_fn

__all__ = [
    "GSM8K_SOURCES",
    "MATH_SOURCES",
    "VERL_KEYWORDS",
    "RewardSpec",
    "Scorer",
    "UnknownDataSource",
    "builtin_score",
    "check_reward_config",
    "check_scorers",
    "check_signature",
    "extra_metrics",
    "gsm8k_extract",
    "gsm8k_score",
    "has_builtin",
    "interpret",
    "last_boxed",
    "load_custom_reward",
    "math_equivalent",
    "math_normalise",
    "math_score",
    "overlong_penalty",
    "serve_fd",
    "spec_from_config",
    "worker_main",
]

PATH_KEY = "custom_reward_function.path"

# The data sources verl's default_compute_score routes to its gsm8k and math_reward scorers.
GSM8K_SOURCES = frozenset({"openai/gsm8k"})
MATH_SOURCES = frozenset(
    {"lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"}
)

# verl's reward_model.reward_kwargs for its dapo manager (newer verl: reward.reward_kwargs).
_MANAGER_KWARGS = frozenset({"max_resp_len", "overlong_buffer_cfg"})


class UnknownDataSource(LookupError):
    """No built-in scorer for this data source (verl raises NotImplementedError)."""


# --------------------------------------------------------------------------- a user's file


def load_custom_reward(path: str, name: str = "compute_score") -> Callable[..., Any]:
    """The function ``name`` of the Python file ``path`` (verl's ``custom_reward_function``;
    ``file://`` and ``pkg://module.path`` as verl reads them). Every failure is a
    :class:`ConfigError` on ``custom_reward_function.path`` naming the file."""
    if path.startswith("pkg://"):
        module = _import_package(path)
    else:
        module = import_file(path.removeprefix("file://"), PATH_KEY)
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(PATH_KEY, f"{path}: has no function {name!r} "
                                    "(custom_reward_function.name)")
    if not callable(fn):
        raise ConfigError(PATH_KEY, f"{path}: {name!r} is a {type(fn).__name__}, not a function "
                                    "(custom_reward_function.name)")
    return fn


def _import_package(path: str) -> Any:
    module_name = path.removeprefix("pkg://").replace("/", ".")
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(PATH_KEY, f"{path}: cannot import {module_name!r}: "
                                    f"{type(exc).__name__}: {exc}") from None


def import_file(path: str, key: str, prefix: str = "rlbus_reward") -> Any:
    """The module of the Python file ``path`` a config ``key`` names (a user's reward
    function or dataset class); every failure a ConfigError on ``key`` naming the file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(key, f"{path}: no such file")
    # A name of its own per file: two reward files never share a module.
    module_name = f"{prefix}_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(key, f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # In sys.modules while it runs: dataclasses and pickling in the file look themselves up.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(module_name, None)
        raise ConfigError(key, f"{path}: syntax error at line {exc.lineno}: {exc.msg}") from None
    except (Exception, SystemExit) as exc:  # the file's own top level raised
        sys.modules.pop(module_name, None)
        # The cause is kept (printed nowhere: a ConfigError is one line) for callers that
        # say more about some failures, e.g. a missing verl (tasks.dataset_class).
        raise ConfigError(key, f"{path}: importing it raised {type(exc).__name__}: "
                               f"{exc}") from exc
    return module


VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""The keywords verl's reward managers call ``compute_score`` with (then reward_kwargs)."""


def check_signature(fn: Callable[..., Any], path: str, name: str,
                    reward_kwargs: Mapping[str, Any]) -> None:
    """Refuse (ConfigError naming ``path:name`` and the keyword) a function that cannot be
    called as verl calls it: by the keywords :data:`VERL_KEYWORDS` and ``reward_kwargs``,
    nothing by position. Otherwise every call of the run would raise (verl's own
    ``reward_score/gsm8k.py`` takes no ``data_source``): exit 2 before anything starts."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its calls will tell
        return
    problem = _signature_problem(sig, [*VERL_KEYWORDS, *reward_kwargs])
    if problem is not None:
        call = ", ".join(f"{k}=..." for k in VERL_KEYWORDS)
        raise ConfigError(PATH_KEY, f"{path}:{name} {problem}: verl calls it as {name}({call}) "
                                    "plus custom_reward_function.reward_kwargs (a **kwargs "
                                    "parameter takes the keywords it does not use)")


def _signature_problem(sig: inspect.Signature, keywords: list[str]) -> str | None:
    """Why ``sig`` cannot be called with exactly these ``keywords`` (None: it can)."""
    kinds = {name: p.kind for name, p in sig.parameters.items()}
    takes_any = inspect.Parameter.VAR_KEYWORD in kinds.values()
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for key in keywords:
        if kinds.get(key) is inspect.Parameter.POSITIONAL_ONLY:
            return f"takes {key!r} only by position"
        if kinds.get(key) not in by_keyword and not takes_any:
            return f"cannot take the keyword {key!r}"
    for name, p in sig.parameters.items():
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) \
                and name not in keywords:
            return f"needs the argument {name!r}, which verl does not pass"
    return None


# --------------------------------------------------------------------------- GSM8K


_GSM8K_TAIL = 300  # verl matches only the last 300 characters (the answer is at the end)
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_extract(text: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K-style response. ``strict``: the last ``#### N`` (commas
    and ``$`` dropped); ``flexible``: the last number-like run that is not just ``.``."""
    tail = text[-_GSM8K_TAIL:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method != "flexible":
        raise ValueError(f"gsm8k method {method!r}: strict or flexible")
    found = _GSM8K_NUMBER.findall(tail)
    if not found:
        return None
    usable = [x for x in found if x not in ("", ".")]
    # verl's loop leaves the first match when none is usable: it then scores format_score.
    return usable[-1] if usable else found[0]


def gsm8k_score(solution_str: str, ground_truth: Any, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` for the right final answer, ``format_score`` for a wrong one that is
    well formed, 0 when none can be read (verl's defaults: strict, 0.0, 1.0)."""
    answer = gsm8k_extract(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == _text(ground_truth) else float(format_score)


def _text(value: Any) -> str:
    # verl's data hold ground truths as strings; a number is read as its text.
    return value if isinstance(value, str) else str(value)


# --------------------------------------------------------------------------- MATH


class _Unnormalisable(ValueError):
    """verl's normaliser raises on these strings; equivalence is then plain equality."""


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (balanced braces) or ``\\boxed x`` of a
    response; None when there is none. As verl: a ``\\boxed `` (with a space) anywhere wins
    and runs to the next ``$``; an ``\\fbox`` gives no answer."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    opening = start + len("\\boxed")
    if text[opening:opening + 1] != "{":
        return None
    depth = 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[opening + 1:i]
    return None


_PLAIN_REPLACEMENTS = (
    ("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
    ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""),
)


def math_normalise(s: str) -> str:
    """The MATH answer normal form (the Hendrycks MATH rules verl uses): spacing, ``\\left``
    / ``\\right``, degrees, dollars, units and percent signs dropped, ``dfrac``/``tfrac`` as
    ``frac``, a short ``x =`` prefix dropped, ``\\sqrt2`` / ``\\frac12`` / ``1/2`` braced,
    ``0.5`` as ``\\frac{1}{2}``. Raises _Unnormalisable where verl's rules raise."""
    for old, new in _PLAIN_REPLACEMENTS:
        s = s.replace(old, new)
    s = _drop_units(s)
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs, _, rhs = s.partition("=")
    if s.count("=") == 1 and len(lhs) <= 2:
        s = rhs
    s = _brace_sqrt(s).replace(" ", "")
    s = _brace_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def _drop_units(s: str) -> str:
    # "\text{ " marks units on the right; more than one is not a form the rules know.
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise _Unnormalisable(s)
    return parts[0]


def _brace_sqrt(s: str) -> str:
    head, *rest = s.split("\\sqrt")
    out = [head]
    for part in rest:
        if not part:
            raise _Unnormalisable(s)
        out.append("\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:])
    return "".join(out)


def _brace_fracs(s: str) -> str:
    head, *rest = s.split("\\frac")
    out = [head]
    for part in rest:
        if not part:
            raise _Unnormalisable(s)
        if part[0] == "{":
            out.append("\\frac" + part)
        elif len(part) < 2:
            return s  # "\frac1" alone: left as written
        elif part[1] == "{":
            out.append("\\frac{" + part[0] + "}" + part[1:])
        else:
            out.append("\\frac{" + part[0] + "}{" + part[1] + "}" + part[2:])
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def math_equivalent(a: str, b: str) -> bool:
    """Equal after :func:`math_normalise`, or as written where it cannot normalise."""
    try:
        return math_normalise(a) == math_normalise(b)
    except _Unnormalisable:
        return a == b


def math_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the last boxed answer is equivalent to the ground truth, else 0.0."""
    answer = last_boxed(solution_str)
    return 1.0 if answer is not None and math_equivalent(answer, _text(ground_truth)) else 0.0


# --------------------------------------------------------------------------- by data source


def has_builtin(data_source: str) -> bool:
    """Whether rlbus has a built-in scorer for ``data_source`` (verl's routing)."""
    return data_source in GSM8K_SOURCES or data_source in MATH_SOURCES


def builtin_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: Any = None, **_: Any) -> float:
    """verl's ``default_compute_score`` for the sources rlbus knows; UnknownDataSource else."""
    if data_source in GSM8K_SOURCES:
        return gsm8k_score(solution_str, ground_truth)
    if data_source in MATH_SOURCES:
        return math_score(solution_str, ground_truth)
    raise UnknownDataSource(f"no built-in reward for data_source={data_source!r}; set "
                            "custom_reward_function.path")


def check_scorers(cfg: Any, data_sources: Iterable[str]) -> None:
    """Refuse, before anything starts, data whose ``data_source`` has no built-in scorer when
    no ``custom_reward_function.path`` is set (verl raises NotImplementedError mid-run)."""
    check_reward_config(cfg)
    if cfg.custom_reward_function.path:
        return
    unknown = sorted({ds for ds in data_sources if ds and not has_builtin(ds)})
    if unknown:
        known = sorted(GSM8K_SOURCES | MATH_SOURCES)
        raise ConfigError(PATH_KEY, f"the data hold data_source {', '.join(map(repr, unknown))} "
                                    f"with no built-in scorer (built in: {', '.join(known)}); "
                                    "name a reward function file")


# --------------------------------------------------------------------------- managers


@dataclass(frozen=True)
class RewardSpec:
    """Everything a reward worker needs to build its :class:`Scorer` (picklable builtins)."""

    custom_path: str | None = None
    custom_name: str = "compute_score"
    custom_kwargs: dict[str, Any] = field(default_factory=dict)
    legacy_fn: str | None = None
    manager: str = "naive"
    overlong_enable: bool = False
    overlong_len: int = 0
    overlong_penalty_factor: float = 0.0
    overlong_log: bool = False
    max_resp_len: int = 1

    def legacy(self, data_source: str) -> bool:
        """rlbus's own ``(response, answer)`` reward scores this sample (no custom function
        and no data source)."""
        return not self.custom_path and not data_source


def spec_from_config(cfg: Any) -> RewardSpec:
    """The reward spec of a run; raises ConfigError for a bad reward setting (the custom
    function is loaded once here, so a bad file is refused before anything starts)."""
    crf, rm = cfg.custom_reward_function, cfg.reward_model
    extra = _nested(rm.reward_kwargs)
    unknown = sorted(set(extra) - _MANAGER_KWARGS)
    if unknown:
        raise ConfigError("reward_model.reward_kwargs",
                          f"unknown {', '.join(unknown)} (rlbus's reward managers take "
                          f"{', '.join(sorted(_MANAGER_KWARGS))})")
    buffer = {"enable": rm.overlong_buffer.enable, "len": rm.overlong_buffer.len,
              "penalty_factor": rm.overlong_buffer.penalty_factor,
              "log": rm.overlong_buffer.log, **_buffer_kwargs(extra)}
    try:
        spec = RewardSpec(
            custom_path=crf.path or None, custom_name=crf.name,
            custom_kwargs=dict(crf.reward_kwargs), legacy_fn=cfg.task.reward_fn,
            manager=rm.reward_manager, overlong_enable=_flag(buffer["enable"]),
            overlong_len=int(buffer["len"]),
            overlong_penalty_factor=float(buffer["penalty_factor"]),
            overlong_log=_flag(buffer["log"]),
            max_resp_len=int(extra.get("max_resp_len", cfg.rollout.max_new_tokens)),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError("reward_model.reward_kwargs", f"not a number or flag: {exc}") from None
    _check_overlong(spec)
    if spec.custom_path:
        fn = load_custom_reward(spec.custom_path, spec.custom_name)
        check_signature(fn, spec.custom_path, spec.custom_name, spec.custom_kwargs)
    try:
        load_reward_fn(spec.legacy_fn)
    except RewardFnError as exc:
        raise ConfigError("task.reward_fn", str(exc)) from None
    return spec


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"{value!r} is not true or false")


def _nested(options: Mapping[str, Any]) -> dict[str, Any]:
    """``{"overlong_buffer_cfg.len": 4}`` (what ``+reward_model.reward_kwargs.
    overlong_buffer_cfg.len=4`` adds) as ``{"overlong_buffer_cfg": {"len": 4}}``."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        *parents, leaf = str(key).split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError("reward_model.reward_kwargs", f"{key}: {part} is not a mapping")
        node[leaf] = dict(value) if isinstance(value, Mapping) else value
    return out


def _buffer_kwargs(extra: Mapping[str, Any]) -> dict[str, Any]:
    given = extra.get("overlong_buffer_cfg") or {}
    if not isinstance(given, Mapping):
        raise ConfigError("reward_model.reward_kwargs",
                          "overlong_buffer_cfg must be a mapping "
                          "(enable, len, penalty_factor, log)")
    unknown = sorted(set(given) - {"enable", "len", "penalty_factor", "log"})
    if unknown:
        raise ConfigError("reward_model.reward_kwargs",
                          f"overlong_buffer_cfg has unknown {', '.join(unknown)}")
    return dict(given)


def _check_overlong(spec: RewardSpec) -> None:
    """verl's dapo manager asserts these at start; rlbus refuses them as config errors."""
    if not spec.overlong_enable:
        return
    key = "reward_model.overlong_buffer"
    if spec.manager != "dapo":
        raise ConfigError(f"{key}.enable", "the overlong penalty is the dapo reward manager's; "
                                           "set reward_model.reward_manager=dapo")
    if spec.overlong_len <= 0:
        raise ConfigError(f"{key}.len", "must be positive when the overlong penalty is on")
    if spec.max_resp_len < spec.overlong_len:
        raise ConfigError(f"{key}.len", f"{spec.overlong_len} is more than the longest response "
                                        f"(rollout.max_new_tokens={spec.max_resp_len})")


def check_reward_config(cfg: Any) -> RewardSpec:
    """:func:`spec_from_config` by the name of what it is for: call before anything starts."""
    return spec_from_config(cfg)


def overlong_penalty(response_len: int, max_resp_len: int, buffer_len: int,
                     penalty_factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_resp_len - buffer_len`` tokens, then
    falling linearly to ``-penalty_factor`` at ``max_resp_len``."""
    exceed = response_len - (max_resp_len - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


def interpret(result: Any) -> tuple[float, dict[str, float]]:
    """A reward function's return value as (reward, extra info): a number (verl then logs it
    as ``acc`` too), or a dict whose ``score`` is the reward and whose other numeric values
    are the extra info (text values are left out)."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise TypeError(f"returned a dict without a 'score' key: keys {sorted(result)}")
        reward = _number(result["score"], "its 'score'")
        extra = {str(k): x for k, v in result.items()
                 if k != "score" and (x := _as_float(v)) is not None and math.isfinite(x)}
        return reward, extra
    reward = _number(result, "it")
    return reward, {"acc": reward}


def _as_float(value: Any) -> float | None:
    """A number (bool, int, float, a numpy or torch scalar) as a float; None for text or
    anything else."""
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _number(value: Any, what: str) -> float:
    reward = _as_float(value)
    if reward is None:
        raise TypeError(f"returned {type(value).__name__} {value!r} as the reward; expected a "
                        "number or a dict with a numeric 'score'")
    if not math.isfinite(reward):
        raise ValueError(f"{what} is {reward}: a reward must be a finite number")
    return reward


def extra_metrics(extras: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """A step's metrics from its samples' extra reward info: ``reward_extra/{key}/mean``
    over the samples that have the key (a verl reward's dict keys, dapo's ``overlong*``)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for extra in extras:
        for key, value in extra.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {f"reward_extra/{key}/mean": sums[key] / counts[key] for key in sorted(sums)}


class Scorer:
    """One reward worker's scoring: the spec's function loaded once, then one call per
    sample. ``item``: ``(data_source, solution_str, ground_truth, extra_info,
    response_len)``; returns (reward, extra info) or raises what the function raised."""

    def __init__(self, spec: RewardSpec) -> None:
        self.spec = spec
        self.custom = (load_custom_reward(spec.custom_path, spec.custom_name)
                       if spec.custom_path else None)
        self.legacy_fn = load_reward_fn(spec.legacy_fn)

    def __call__(self, item: tuple[str, str, Any, Any, int]) -> tuple[float, dict[str, float]]:
        data_source, solution, truth, extra_info, response_len = item
        if self.spec.legacy(data_source):
            return _number(self.legacy_fn(solution, _text(truth)), "it"), {}
        reward, extra = interpret(self._verl_call(data_source, solution, truth, extra_info))
        if self.spec.manager == "dapo" and self.spec.overlong_enable:
            penalty = overlong_penalty(response_len, self.spec.max_resp_len,
                                       self.spec.overlong_len, self.spec.overlong_penalty_factor)
            reward += penalty
            if self.spec.overlong_log:
                extra["overlong_reward"] = penalty
                extra["overlong"] = float(penalty < 0)
        return reward, extra

    def _verl_call(self, data_source: str, solution: str, truth: Any, extra_info: Any) -> Any:
        info = dict(extra_info or {})
        # verl's managers add these to extra_info (a single-turn rollout: no turns, no
        # rollout-side scores); a function written for verl may read them.
        info.setdefault("num_turns", None)
        info.setdefault("rollout_reward_scores", {})
        fn = self.custom or builtin_score
        # verl: keywords only, reward_kwargs override the call's own keywords.
        kwargs = {"data_source": data_source, "solution_str": solution,
                  "ground_truth": truth, "extra_info": info, **self.spec.custom_kwargs}
        result = fn(**kwargs)
        if inspect.isawaitable(result):  # verl also accepts an async compute_score
            result = asyncio.run(_awaited(result))
        return result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


# --------------------------------------------------------------------------- the worker


def serve_fd(fd: int) -> None:
    """A reward worker process (``python -c``) on the inherited socket ``fd``: its first
    message is ``(spec, sys.path)``, then :func:`worker_main`."""
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the rollouter's to handle
    conn = Connection(fd)
    try:
        spec, path = conn.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = path
    worker_main(conn, spec)


def worker_main(conn: Any, spec: RewardSpec) -> None:
    """A reward worker: build the scorer once (reply ``("ready", "")`` or ``("dead",
    traceback)``), then for each item received reply ``("ok", reward, extra, seconds)`` or
    ``("err", traceback, "Type: message", seconds)``, and for a list of items the list of
    their replies (one round trip for many fast calls); ends at None or when the pipe
    closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the rollouter's to handle
    try:
        scorer = Scorer(spec)
    except BaseException as exc:
        conn.send(("dead", _describe(exc)))
        return
    conn.send(("ready", ""))
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        reply: Any = ([_score(scorer, one) for one in item] if isinstance(item, list)
                      else _score(scorer, item))
        try:
            conn.send(reply)
        except OSError:  # the rollouter is gone (or gave up on this call): so are we
            return


def _score(scorer: Scorer, item: tuple[str, str, Any, Any, int]) -> tuple[Any, ...]:
    t0 = time.perf_counter()
    try:
        reward, extra = scorer(item)
        return ("ok", reward, extra, time.perf_counter() - t0)
    except Exception as exc:
        return ("err", traceback.format_exc(), f"{type(exc).__name__}: {exc}",
                time.perf_counter() - t0)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConfigError):
        return str(exc)
    return "".join(traceback.format_exception(exc))
