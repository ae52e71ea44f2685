"""verl-format data: ``data.train_files`` / ``data.val_files`` read as verl's RLHFDataset reads
them, and the run's prompts drawn from them in verl's sampler order.

A record (a parquet row or a JSON line) holds ``prompt`` (``data.prompt_key``: a list of chat
messages, or a string, which becomes one user message), ``data_source``
(``data.reward_fn_key``), ``reward_model.ground_truth`` and, optionally, ``extra_info``. Its
prompt is rendered with the model tokenizer's chat template
(``apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
**data.apply_chat_template_kwargs)``) and encoded without special tokens, so a template that
writes the BOS token is not given a second one. ``data.train_max_samples`` picks records as
verl does (with ``data.shuffle``: ``numpy.random.default_rng(data.seed).choice``, else the
first ones), then ``data.filter_overlong_prompts`` drops prompts longer than
``data.max_prompt_length`` tokens, then ``data.truncation`` cuts the others (left, right,
middle) or refuses them (error).

Everything wrong with the data is found when the files are loaded, before anything starts
(:func:`check_data`): a :class:`runconfig.ConfigError` naming the key, the file, the column
and the row. verl finds some of it only when the record is drawn, mid-run.

The run's prompt ``i`` is a pure function of (records, ``data.seed``, ``i``): epoch
``i // N`` visits the records in the order of torch's ``RandomSampler`` with a generator
seeded with ``data.seed``, the permutation verl's sampler draws for epoch ``e`` (torch's
sampler takes two ``randperm`` calls a pass), or in file order without ``data.shuffle``. A
resumed trainer, which issues ticket ``i`` from the count of tickets its log records,
continues with the next prompt of the epoch; no prompt repeats within an epoch. With
``trainer.total_epochs`` the source ends after that many passes (``VerlPrompts.limit``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from runconfig import ConfigError
from tasks import Prompt

__all__ = [
    "AGENT_LOOPS",
    "AgentOptions",
    "VerlPrompts",
    "VerlRecord",
    "check_data",
    "data_files",
    "load_records",
    "records_for",
    "train_prompts",
    "truncate",
]

TRUNCATIONS = ("error", "left", "right", "middle")
_SPLIT_KEYS = {"train": "data.train_files", "val": "data.val_files"}


class VerlRecord(NamedTuple):
    """One prompt of a verl data file, ready to generate from."""

    # Position among the records loaded (after max_samples and the filter). The field shadows
    # tuple.index (a method): verl's name, which rollouter.validation reads.
    index: int  # type: ignore[assignment]
    prompt_ids: list[int]  # the rendered prompt's token ids, truncated
    text: str  # the rendered prompt (chat template applied), before truncation
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] | None
    agent_name: str = "single_turn_agent"
    """verl's agent loop of the record: its ``agent_name`` column, else
    ``rollout.agent.default_agent_loop``; a ``tool_agent`` prompt is rendered with the tools'
    schemas and generated as a conversation (rollout.multi_turn)."""


AGENT_LOOPS = ("single_turn_agent", "tool_agent")
"""verl's agent loops rlbus runs (a record's ``agent_name``)."""


class AgentOptions(NamedTuple):
    """How records become prompts of an agent loop: ``default`` for records without
    ``agent_name``; ``tools``: the tools' OpenAI schemas a ``tool_agent`` prompt is rendered
    with (the chat template's ``tools=``)."""

    default: str = "single_turn_agent"
    tools: tuple[dict[str, Any], ...] = ()


SINGLE_TURN = AgentOptions()
"""Every record a single response unless it says otherwise, no tools."""


class _Row(NamedTuple):
    """A raw record and where it came from (for messages)."""

    file: str
    where: str  # "row 3" (parquet) or "line 4" (JSON lines)
    data: dict[str, Any]


MEDIA_COLUMNS = ("images", "videos", "audios")
"""verl's multi-modal columns (data.image_key, video_key, audio_key by default)."""

# ---------------------------------------------------------------------------- reading


def data_files(value: str | Sequence[str] | None) -> list[str]:
    """``data.train_files`` as a list of paths (a path or a list; None: none)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _read_parquet(path: str, key: str) -> tuple[list[str], list[_Row]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise ConfigError(key, f"cannot read {path} as parquet: {exc}") from None
    rows = [_Row(path, f"row {i}", r) for i, r in enumerate(table.to_pylist())]
    return list(table.column_names), rows


def _json_objects(path: str, text: str, key: str) -> list[tuple[str, Any]]:
    """(where, object) of a JSON-lines file, or of a file holding one JSON array."""
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(key, f"{path}: invalid JSON: {exc}") from None
        return [(f"row {i}", obj) for i, obj in enumerate(items)]
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ConfigError(key, f"{path}: line {lineno}: invalid JSON: {exc.msg}") from None
    return out


def _read_json(path: str, key: str) -> tuple[list[str], list[_Row]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"cannot read {path}: {exc}") from None
    rows, columns = [], {}
    for where, obj in _json_objects(path, text, key):
        if not isinstance(obj, dict):
            raise ConfigError(key, f"{path}: {where}: expected a JSON object (a record), "
                                   f"got {type(obj).__name__}")
        columns.update(dict.fromkeys(obj))
        rows.append(_Row(path, where, obj))
    return list(columns), rows


def count_records(files: str | Sequence[str] | None, max_samples: int = -1) -> int:
    """How many records ``files`` hold after ``data.train_max_samples`` (verl's rule, as
    :func:`load_records` picks them), without loading them: a parquet file's row count from
    its footer, a JSON file's objects. A file that cannot be read is a ConfigError naming
    ``data.train_files``."""
    key, total = _SPLIT_KEYS["train"], 0
    for path in data_files(files):
        if not os.path.isfile(path):
            raise ConfigError(key, f"no such file: {path}")
        if path.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                total += pq.ParquetFile(path).metadata.num_rows
            except (OSError, pa.ArrowException) as exc:
                raise ConfigError(key, f"cannot read {path} as parquet: {exc}") from None
        else:
            total += len(_read_file(path, key)[1])
    return total if max_samples <= 0 else min(total, max_samples)


def _read_file(path: str, key: str) -> tuple[list[str], list[_Row]]:
    """The columns and rows of one data file; a ConfigError naming ``key`` and the file."""
    if not os.path.isfile(path):
        raise ConfigError(key, f"no such file: {path}")
    if path.endswith(".parquet"):
        columns, rows = _read_parquet(path, key)
    elif path.endswith((".jsonl", ".json")):
        columns, rows = _read_json(path, key)
    else:
        raise ConfigError(key, f"{path}: unsupported file format (expected .parquet, .jsonl "
                               "or .json, as verl)")
    if not rows:
        raise ConfigError(key, f"{path}: no records")
    return columns, rows


def _check_columns(path: str, columns: list[str], rows: list[_Row], data_cfg: Any,
                   key: str) -> None:
    """The columns a prompt and its reward need: prompt_key, reward_fn_key, reward_model."""
    have = ", ".join(columns)
    for col, by in ((data_cfg.prompt_key, "data.prompt_key"),
                    (data_cfg.reward_fn_key, "data.reward_fn_key"),
                    ("reward_model", "reward_model.ground_truth")):
        if col not in columns:
            raise ConfigError(key, f"{path}: no column '{col}' ({by}); its columns: {have}")
    if not any(isinstance(r.data.get("reward_model"), Mapping)
               and "ground_truth" in r.data["reward_model"] for r in rows):
        raise ConfigError(key, f"{path}: column 'reward_model' has no 'ground_truth' field "
                               "(the reward's ground truth)")
    for col in MEDIA_COLUMNS:
        carrying = next((r for r in rows if col in columns and r.data.get(col)), None)
        if carrying is not None:
            raise ConfigError(key, f"{path}: {carrying.where} carries '{col}': rlbus reads "
                                   "text prompts only, so the job would train without them")


# ---------------------------------------------------------------------------- records


def _messages(prompt: Any) -> list[dict[str, Any]] | None:
    """The chat messages of a prompt value: a string is one user message; None if it is
    neither a string nor a list of {role, content} messages with text content."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        return None
    out = []
    for m in prompt:
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            return None
        out.append(dict(m))
    return out


def _fields(row: _Row, data_cfg: Any, key: str) -> tuple[list[dict[str, Any]], str, Any,
                                                           dict[str, Any] | None]:
    """(messages, data_source, ground_truth, extra_info) of a row; a ConfigError naming the
    file, the row and the column when one is malformed."""
    at = f"{row.file}: {row.where}"
    messages = _messages(row.data.get(data_cfg.prompt_key))
    if messages is None:
        raise ConfigError(key, f"{at}: column '{data_cfg.prompt_key}' (data.prompt_key) is "
                               "neither a string nor a list of {role, content} text messages")
    source = row.data.get(data_cfg.reward_fn_key)
    if not isinstance(source, str):
        raise ConfigError(key, f"{at}: column '{data_cfg.reward_fn_key}' "
                               f"(data.reward_fn_key) is {source!r}, not a string")
    rm = row.data.get("reward_model")
    if not isinstance(rm, Mapping) or "ground_truth" not in rm:
        raise ConfigError(key, f"{at}: column 'reward_model' has no 'ground_truth' field")
    extra = row.data.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(key, f"{at}: column 'extra_info' is {type(extra).__name__}, not a "
                               "mapping")
    return messages, source, rm["ground_truth"], None if extra is None else dict(extra)


def truncate(ids: list[int], max_length: int, truncation: str) -> list[int]:
    """verl's prompt truncation: ``left`` keeps the last ``max_length`` ids, ``right`` the
    first, ``middle`` the first ``max_length // 2`` and the last ``max_length -
    max_length // 2``; ``error`` raises ValueError for a prompt longer than ``max_length``."""
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[-max_length:]
    if truncation == "right":
        return ids[:max_length]
    if truncation == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head):]
    if truncation == "error":
        raise ValueError(f"prompt of {len(ids)} tokens is longer than {max_length}")
    raise ValueError(f"unknown truncation {truncation!r} (expected one of {TRUNCATIONS})")


def _hf(tokenizer: Any) -> Any:
    """The transformers tokenizer behind ``tokenizer`` (policy.text.HFTokenizer's ``hf``, or
    the tokenizer itself); None when it has no chat templating (the char tokenizer)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    return hf if hasattr(hf, "apply_chat_template") else None


def _renderer(tokenizer: Any, data_cfg: Any, key: str) -> Any:
    hf = _hf(tokenizer)
    if hf is None:
        raise ConfigError(key, "verl data needs the model's tokenizer and chat template: set "
                               "actor_rollout_ref.model.path (model.kind=hf) to a local model "
                               "directory with its tokenizer")
    kwargs = {k: v for k, v in dict(data_cfg.apply_chat_template_kwargs).items()
              if k not in ("tokenize", "return_dict", "return_tensors")}
    if getattr(hf, "chat_template", None) is None and kwargs.get("chat_template") is None:
        raise ConfigError(key, "the model's tokenizer has no chat template (set "
                               "data.apply_chat_template_kwargs.chat_template, as verl asks)")
    options = {"add_generation_prompt": True, **kwargs, "tokenize": False}

    def render(messages: list[dict[str, Any]],
               tools: Sequence[dict[str, Any]] = ()) -> tuple[str, list[int]]:
        with_tools = {**options, "tools": [dict(t) for t in tools]} if tools else options
        text = hf.apply_chat_template(messages, **with_tools)
        return text, list(hf.encode(text, add_special_tokens=False))

    return render


def _select(rows: list[_Row], max_samples: int, data_cfg: Any) -> list[_Row]:
    """verl's ``*_max_samples``: a random choice without replacement (seeded with
    ``data.seed``) when shuffling, else the first ones; -1 (or more than there are): all."""
    if max_samples <= 0 or max_samples >= len(rows):
        return rows
    if not data_cfg.shuffle:
        return rows[:max_samples]
    import numpy as np

    picked = np.random.default_rng(data_cfg.seed).choice(len(rows), size=max_samples,
                                                         replace=False)
    return [rows[int(i)] for i in picked]


def load_records(files: str | Sequence[str], data_cfg: Any, tokenizer: Any, *,
                 split: str, agent: AgentOptions = SINGLE_TURN) -> list[VerlRecord]:
    """The records of ``files`` (split ``train`` or ``val``: which max_samples applies and
    which key errors name), rendered, filtered and truncated as verl does. Blocking."""
    key = _SPLIT_KEYS[split]
    paths = data_files(files)
    if not paths:
        raise ConfigError(key, "no data files given")
    render = _renderer(tokenizer, data_cfg, key)
    if data_cfg.custom_cls.path is not None:
        key = "data.custom_cls.path"  # what is wrong with a record is the class's making
        rows = _class_rows(paths, data_cfg, tokenizer, split)
    else:
        rows = _file_rows(paths, data_cfg, key, split)
    records: list[VerlRecord] = []
    longest = 0
    for row in rows:
        record = _record(row, data_cfg, render, key, len(records), agent)
        if record is None:
            continue  # filtered: longer than max_prompt_length
        longest = max(longest, len(record.prompt_ids))
        records.append(record)
    if not records:
        raise ConfigError(key, f"no prompt of {', '.join(paths)} is at most "
                               f"data.max_prompt_length={data_cfg.max_prompt_length} tokens "
                               "(data.filter_overlong_prompts dropped them all)")
    return records


def _file_rows(paths: list[str], data_cfg: Any, key: str, split: str) -> list[_Row]:
    rows: list[_Row] = []
    for path in paths:
        columns, found = _read_file(path, key)
        _check_columns(path, columns, found, data_cfg, key)
        rows.extend(found)
    return _select(rows, getattr(data_cfg, f"{split}_max_samples"), data_cfg)


def _class_rows(paths: list[str], data_cfg: Any, tokenizer: Any, split: str) -> list[_Row]:
    """The items of verl's ``data.custom_cls`` over ``paths`` (it applies max_samples)."""
    from tasks.dataset_class import PATH_KEY, class_items, dataset_class

    custom = data_cfg.custom_cls
    cls = dataset_class(custom.path, custom.name)
    items = class_items(cls, paths, data_cfg, _hf(tokenizer),
                        getattr(data_cfg, f"{split}_max_samples"))
    source = f"{custom.path}: {custom.name}"
    if not items:
        raise ConfigError(PATH_KEY, f"{source} made no record of {', '.join(paths)}")
    rows = [_Row(source, f"item {i}", item) for i, item in enumerate(items)]
    columns = sorted({k for item in items for k in item})
    _check_columns(source, columns, rows, data_cfg, PATH_KEY)
    return rows


def _record(row: _Row, data_cfg: Any, render: Any, key: str, index: int,
            agent: AgentOptions) -> VerlRecord | None:
    messages, source, truth, extra = _fields(row, data_cfg, key)
    loop = _agent_name(row, key, agent.default)
    try:
        text, ids = render(messages, agent.tools if loop == "tool_agent" else ())
    except Exception as exc:  # a template's error is the record's fault: name it
        raise ConfigError(key, f"{row.file}: {row.where}: the chat template fails on its "
                               f"'{data_cfg.prompt_key}': {type(exc).__name__}: {exc}") from None
    limit = data_cfg.max_prompt_length
    if len(ids) > limit and data_cfg.filter_overlong_prompts:
        return None
    try:
        ids = truncate(ids, limit, data_cfg.truncation)
    except ValueError:
        raise ConfigError(key, f"{row.file}: {row.where}: prompt of {len(ids)} tokens is "
                               f"longer than data.max_prompt_length={limit} "
                               "(data.truncation=error; or set data.filter_overlong_prompts="
                               "true, or truncation left/right/middle)") from None
    return VerlRecord(index, ids, text, source, truth, extra, loop)


def _agent_name(row: _Row, key: str, default: str) -> str:
    """The record's agent loop: its ``agent_name`` (verl's column), else ``default``."""
    name = row.data.get("agent_name")
    if name is None or name == "":
        return default
    if name not in AGENT_LOOPS:
        raise ConfigError(key, f"{row.file}: {row.where}: agent_name {name!r} is not an agent "
                               f"loop rlbus runs ({', '.join(AGENT_LOOPS)})")
    return str(name)


# ---------------------------------------------------------------------------- run config

_CACHE: dict[tuple[Any, ...], list[VerlRecord]] = {}


def _cache_key(cfg: Any, split: str) -> tuple[Any, ...]:
    import msgspec

    stats: list[tuple[str, int | None, int | None]] = []
    for path in data_files(getattr(cfg.data, f"{split}_files")):
        try:
            st = os.stat(path)
            stats.append((path, st.st_mtime_ns, st.st_size))
        except OSError:
            stats.append((path, None, None))
    return (split, tuple(stats), msgspec.json.encode(cfg.data), cfg.model.kind, cfg.model.path,
            msgspec.json.encode(cfg.rollout.multi_turn), cfg.rollout.agent.default_agent_loop)


def agent_options(cfg: Any) -> AgentOptions:
    """How the run's records become prompts of an agent loop: ``rollout.agent``'s default
    loop, and the tools' schemas (``rollout.multi_turn``, loaded: a bad tool config is a
    ConfigError naming its key)."""
    from agent.toolbox import ToolConfigError, tool_schemas

    multi_turn = cfg.rollout.multi_turn
    try:
        tools = tool_schemas(multi_turn)
    except ToolConfigError as exc:
        raise ConfigError(exc.key.removeprefix("actor_rollout_ref."), str(exc)) from None
    except ValueError as exc:
        raise ConfigError("rollout.multi_turn.tool_config_path", str(exc)) from None
    return AgentOptions(cfg.rollout.agent.default_agent_loop, tools)


def records_for(cfg: Any, split: str, tokenizer: Any = None) -> list[VerlRecord]:
    """The records of a run's ``data.{split}_files`` (``tokenizer`` built from ``model.*``
    when None). Loaded once per process: a check before start and the component that uses
    them share one load."""
    key = _cache_key(cfg, split)
    if key not in _CACHE:
        if tokenizer is None:
            from policy.text import build_tokenizer

            tokenizer = build_tokenizer(cfg.model)
        if len(_CACHE) >= 4:  # a long-lived process reloading other configs (tests)
            _CACHE.clear()
        _CACHE[key] = load_records(getattr(cfg.data, f"{split}_files"), cfg.data, tokenizer,
                                   split=split, agent=agent_options(cfg))
    return _CACHE[key]


def _prompts_per_step(cfg: Any) -> int:
    return cfg.trainer.ppo_mini_batch_size * cfg.async_training.require_batches


def _check_epochs(cfg: Any, n: int) -> None:
    """``trainer.total_epochs`` passes over ``n`` prompts must hold the run's steps."""
    epochs, batch = cfg.trainer.total_epochs, cfg.data.epoch_batch_size
    if batch > n:
        raise ConfigError("data.epoch_batch_size", f"the data hold {n} prompts, no whole batch "
                          f"of {batch} (data.train_batch_size sets it on a classic line)"
                          f"{_filtered(cfg, n)}")
    if epochs is None:
        return
    need = _prompts_per_step(cfg)
    per_epoch = n - (n % batch if batch else 0)  # VerlPrompts: the last partial batch dropped
    steps = per_epoch * epochs // need
    total = cfg.trainer.total_training_steps
    if total > steps:
        raise ConfigError("trainer.total_epochs", f"{epochs} epoch(s) of {per_epoch} prompts "
                          f"make {steps} steps of {need} prompts (ppo_mini_batch_size x "
                          f"require_batches), fewer than trainer.total_training_steps={total}"
                          f"{_filtered(cfg, n)}; set trainer.total_training_steps<={steps} or "
                          "more epochs")


def _filtered(cfg: Any, n: int) -> str:
    """Why ``n`` prompts are fewer than the files' records, when they are."""
    if cfg.data.custom_cls.path is not None:
        return f" (made by {cfg.data.custom_cls.name}, data.custom_cls)"
    dropped = count_records(cfg.data.train_files, cfg.data.train_max_samples) - n
    return (f" (data.filter_overlong_prompts dropped {dropped} of the files' records, and "
            "the steps were counted from the files)" if dropped > 0 else "")


def check_data(cfg: Any) -> set[str]:
    """Load every data file of the run (train and val) as the components will, so that a
    missing or unreadable file, a missing column, a malformed record or an overlong prompt
    (truncation=error) is a ConfigError before anything starts, and the reward settings with
    them (``tasks.rewards.check_scorers``: the reward file loads, every data source has a
    scorer); returns the data sources of the records loaded (empty without data files)."""
    from tasks.rewards import check_scorers

    d = cfg.data
    agent_options(cfg)  # the tool files load (a bad one exits 2 naming its key)
    if d.train_files is None and d.val_files is None:
        check_scorers(cfg, ())  # the reward settings alone (a reward file that cannot load)
        return set()
    if d.train_files is not None and cfg.task.kind == "jsonl":
        raise ConfigError("task.kind", "task.kind=jsonl and data.train_files both name the "
                                       "prompts; give one of them")
    sources: set[str] = set()
    tokenizer = None
    for split in ("train", "val"):
        if getattr(d, f"{split}_files") is None:
            continue
        if tokenizer is None and _cache_key(cfg, split) not in _CACHE:
            from policy.text import build_tokenizer

            tokenizer = build_tokenizer(cfg.model)
        records = records_for(cfg, split, tokenizer)
        sources.update(r.data_source for r in records)
        if split == "train":
            _check_epochs(cfg, len(records))
    check_scorers(cfg, sources)  # a data source nothing can score: refused now, not mid-run
    return sources


# ---------------------------------------------------------------------------- the source


class VerlPrompts:
    """The run's prompts from verl records: prompt ``i`` is record ``order(e)[i % P]`` of
    epoch ``e = i // P``, where an epoch takes ``P`` prompts: every one of the N records, or
    with ``epoch_batch`` the whole batches of that many (verl's classic dataloader drops the
    last partial batch: ``P = N - N % epoch_batch``, a new shuffle each epoch); ids ``p{i}``
    stay unique over epochs. ``limit``: prompts there are (P x ``epochs``), None when the
    source cycles forever."""

    def __init__(self, records: Sequence[VerlRecord], *, shuffle: bool = True, seed: int = 1,
                 epochs: int | None = None, epoch_batch: int = 0) -> None:
        if not records:
            raise ValueError("no records")
        if epoch_batch > len(records):
            raise ValueError(f"{len(records)} records hold no batch of {epoch_batch}")
        self.records = list(records)
        self.shuffle = shuffle
        self.seed = seed
        self.epochs = epochs
        self.per_epoch = len(self.records) - (len(self.records) % epoch_batch
                                              if epoch_batch else 0)
        self.limit: int | None = None if epochs is None else self.per_epoch * epochs
        self.index = 0
        self._orders: dict[int, list[int]] = {}
        self._generator: Any = None
        self._next_epoch = 0  # the epoch the generator's next randperm belongs to

    def __len__(self) -> int:
        """The prompts of one epoch (the data epoch of prompt ``i`` is ``i // len``)."""
        return self.per_epoch

    def order(self, epoch: int) -> list[int]:
        """The record positions of ``epoch`` in visiting order."""
        n = len(self.records)
        if not self.shuffle:
            return list(range(n))
        if epoch not in self._orders:
            import torch

            if self._generator is None or epoch < self._next_epoch:
                self._generator = torch.Generator().manual_seed(self.seed)
                self._next_epoch = 0
            while self._next_epoch <= epoch:
                perm = torch.randperm(n, generator=self._generator).tolist()
                # torch's RandomSampler draws a second randperm at the end of each pass (the
                # num_samples % n tail, empty here): the next epoch starts after it.
                torch.randperm(n, generator=self._generator)
                self._orders[self._next_epoch] = perm
                self._next_epoch += 1
            # Open tickets may straddle an epoch boundary: keep this epoch's neighbours.
            for old in [e for e in self._orders if abs(e - epoch) > 1]:
                del self._orders[old]
        return self._orders[epoch]

    def get(self, index: int) -> Prompt:
        if index < 0 or (self.limit is not None and index >= self.limit):
            raise IndexError(f"prompt {index}: the data hold {self.limit} prompts "
                             f"({self.epochs} epoch(s) of {self.per_epoch})")
        epoch, i = divmod(index, self.per_epoch)
        r = self.records[self.order(epoch)[i]]
        answer = "" if r.ground_truth is None else str(r.ground_truth)
        return Prompt(f"p{index}", r.text, answer, list(r.prompt_ids), r.data_source,
                      r.ground_truth, r.extra_info, r.agent_name)

    def next(self) -> Prompt:
        p = self.get(self.index)
        self.index += 1
        return p


def train_prompts(cfg: Any, tokenizer: Any = None) -> VerlPrompts:
    """The prompt source of a run with ``data.train_files``."""
    return VerlPrompts(records_for(cfg, "train", tokenizer), shuffle=cfg.data.shuffle,
                       seed=cfg.data.seed, epochs=cfg.trainer.total_epochs,
                       epoch_batch=cfg.data.epoch_batch_size)
