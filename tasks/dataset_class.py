"""verl's ``data.custom_cls``: the records a user's dataset class makes.

verl builds its train and validation sets with the class ``data.custom_cls.name`` of the
file ``data.custom_cls.path`` when one is given (``get_dataset_class``), constructed as
``cls(data_files=..., tokenizer=..., processor=..., config=<the data section>,
max_samples=...)``, and reads item ``i`` as a dict: ``raw_prompt`` (the chat messages),
``data_source``, ``reward_model``, ``extra_info``, ``agent_name`` (which agent loop). Such a
class usually subclasses verl's ``RLHFDataset`` and maps the rows of the files (recipes add an
instruction to each prompt, set ``agent_name``, or read other layouts); it then needs verl
installed, as in verl.

rlbus constructs the class the same way, once per process when the data are loaded (before
anything starts, so a class that fails is an exit 2 naming the key and the file), takes every
item ``ds[i]`` for ``i < len(ds)`` and reads it as the record a parquet row would be: the
checks, the chat template and truncation that follow are the same. The class applies
``*_max_samples`` itself (verl hands it ``max_samples``), so rlbus does not select again.
Tensors and other values of an item that a record does not read are left out.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from runconfig import ConfigError

__all__ = ["PATH_KEY", "class_items", "dataset_class"]

PATH_KEY = "data.custom_cls.path"
NAME_KEY = "data.custom_cls.name"


def dataset_class(path: str, name: str) -> type:
    """The class ``name`` of the Python file ``path`` (a ConfigError naming the key and the
    file when the file cannot be imported or holds no such class)."""
    from tasks.rewards import import_file

    try:
        module = import_file(path.removeprefix("file://"), PATH_KEY, prefix="rlbus_dataset")
    except ConfigError as exc:
        missing = exc.__cause__
        if not (isinstance(missing, ModuleNotFoundError)
                and (missing.name or "").split(".")[0] == "verl"):
            raise
        import importlib.util

        if importlib.util.find_spec("verl") is None:
            raise ConfigError(PATH_KEY, f"{exc.message}: the class needs verl installed, as in "
                                        "verl (pip install verl)") from None
        raise ConfigError(PATH_KEY, f"{exc.message}: the verl installed here lacks it (the "
                                    "file was written for another verl version)") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        what = "nothing" if cls is None else f"a {type(cls).__name__}"
        raise ConfigError(NAME_KEY, f"{path}: {name!r} is {what}, not a class")
    return cls


def class_items(cls: type, files: Sequence[str], data_cfg: Any, tokenizer: Any,
                max_samples: int) -> list[dict[str, Any]]:
    """Every item of ``cls`` built over ``files`` as verl builds it, as plain dicts whose
    ``data.prompt_key`` holds the item's ``raw_prompt`` when it has one. Blocking."""
    where = f"{data_cfg.custom_cls.path}: {cls.__name__}"
    try:
        dataset = cls(data_files=list(files), tokenizer=tokenizer, processor=None,
                      config=verl_data_config(data_cfg), max_samples=max_samples)
        count = len(dataset)
        items = [dataset[i] for i in range(count)]
    except Exception as exc:  # the user's class: one line naming it, never a traceback
        raise ConfigError(PATH_KEY, f"{where} raised {type(exc).__name__}: {exc}") from None
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ConfigError(PATH_KEY, f"{where}: item {i} is a {type(item).__name__}, not "
                                        "a dict of a record's fields")
        row = {k: v for k, v in item.items() if not _is_tensor(v)}
        if "raw_prompt" in row:
            row[data_cfg.prompt_key] = row["raw_prompt"]
        out.append(row)
    return out


def verl_data_config(data_cfg: Any) -> Any:
    """The run's ``data`` section as verl hands it to a dataset class: an OmegaConf
    ``DictConfig`` where OmegaConf is installed (it is wherever verl is), else a dict that also
    reads by attribute (``config.custom_cls.path`` and ``config.get(...)`` both work)."""
    import msgspec

    tree = msgspec.to_builtins(data_cfg)
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return _AttrDict.of(tree)
    return OmegaConf.create(tree)


class _AttrDict(dict[str, Any]):
    """A dict whose keys read as attributes too, nested."""

    @classmethod
    def of(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return cls({k: cls.of(v) for k, v in value.items()})
        return value

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)
