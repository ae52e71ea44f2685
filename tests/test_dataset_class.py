"""verl's ``data.custom_cls`` (tasks.dataset_class): a user's dataset class makes the records,
constructed and read as verl constructs and reads it; what fails is an exit-2 line naming the
key and the file. The last test runs a class in the ReTool recipe's shape (a subclass of
verl's own RLHFDataset mapping every row) on verl's real code, which `make test` installs
into a folder of its own (.venv/verl-site) so that no other test sees verl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runconfig import Config, ConfigError, load_config
from tasks.chatdemo import REWARD_FILE, build_model, write_parquet
from tasks.chatdemo import records as demo_records
from tasks.verl_data import check_data, records_for

ROOT = Path(__file__).resolve().parents[1]
VERL_SITE = ROOT / ".venv" / "verl-site"

# A class with verl's constructor that needs no verl: it reads the parquet itself, appends an
# instruction to each prompt, names the agent loop, and carries a tensor (as verl's items do).
PLAIN_CLASS = '''
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

SEEN = {}


class InstructedDataset(Dataset):
    def __init__(self, data_files, tokenizer, config, processor=None, max_samples=-1):
        SEEN.update(files=list(data_files), max_samples=max_samples,
                    name=config.custom_cls.name, key=config.get("prompt_key"),
                    template=hasattr(tokenizer, "apply_chat_template"), processor=processor)
        rows = [r for f in data_files for r in pq.read_table(f).to_pylist()]
        self.rows = rows[:max_samples] if max_samples > 0 else rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = dict(self.rows[i])
        messages = [dict(m) for m in row["prompt"]]
        messages[-1]["content"] += " Answer with digits."
        row["raw_prompt"] = messages
        row["agent_name"] = "single_turn_agent"
        row["dummy_tensor"] = torch.tensor([0], dtype=torch.uint8)
        return row
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_model(tmp_path_factory.mktemp("model") / "model")
    (path / "reward.py").write_text(REWARD_FILE)
    return path


def _cfg(model_dir: Path, *overrides: str) -> Config:
    return load_config(None, ["model.kind=hf", f"model.path={model_dir}",
                              f"custom_reward_function.path={model_dir / 'reward.py'}",
                              *overrides])


def _data(tmp_path: Path, n: int = 6) -> tuple[Path, list[dict[str, object]]]:
    rows = demo_records(n, "train", 0)
    return write_parquet(rows, tmp_path / "train.parquet"), rows


def test_the_class_makes_the_records_as_verl_builds_it(tmp_path: Path, model_dir: Path) -> None:
    data, rows = _data(tmp_path)
    cls_file = tmp_path / "my_dataset.py"
    cls_file.write_text(PLAIN_CLASS)
    custom = [f"data.custom_cls.path={cls_file}", "data.custom_cls.name=InstructedDataset"]
    cfg = _cfg(model_dir, f"data.train_files={data}", "data.train_max_samples=4", *custom)
    records = records_for(cfg, "train")
    assert len(records) == 4  # the class took max_samples; rlbus did not pick again
    plain = records_for(_cfg(model_dir, f"data.train_files={data}", "data.shuffle=false",
                             "data.train_max_samples=4"), "train")
    for mine, theirs, row in zip(records, plain, rows, strict=False):
        assert mine.text.replace(" Answer with digits.", "") == theirs.text
        assert "Answer with digits." in mine.text and mine.agent_name == "single_turn_agent"
        assert mine.ground_truth == row["reward_model"]["ground_truth"]  # type: ignore[index]
    seen = sys.modules[next(m for m in sys.modules if m.startswith("rlbus_dataset_"))].SEEN
    assert seen == {"files": [str(data)], "max_samples": 4, "name": "InstructedDataset",
                    "key": "prompt", "template": True, "processor": None}
    assert check_data(cfg)  # the check before start loads it the same way


def test_what_fails_is_one_line_naming_the_key(tmp_path: Path, model_dir: Path) -> None:
    data, _ = _data(tmp_path)
    base = [f"data.train_files={data}"]
    with pytest.raises(ConfigError) as err:
        _cfg(model_dir, *base, f"data.custom_cls.path={tmp_path / 'x.py'}")
    assert err.value.key == "data.custom_cls.name"  # verl's default name is null
    cases = {
        "raise RuntimeError('no network here')": ("data.custom_cls.path", "RuntimeError: no "
                                                  "network here"),
        "from verl.utils.dataset import RLHFDataset": ("data.custom_cls.path",
                                                       "needs verl installed"),
        "X = 1": ("data.custom_cls.name", "'InstructedDataset' is nothing, not a class"),
        PLAIN_CLASS.replace("self.rows = rows", "self.rows = 1 / 0; self.rows = rows"):
            ("data.custom_cls.path", "InstructedDataset raised ZeroDivisionError"),
        PLAIN_CLASS.replace("return row\n", "return [row]\n"):
            ("data.custom_cls.path", "item 0 is a list"),
        PLAIN_CLASS.replace('row["raw_prompt"] = messages', 'row["raw_prompt"] = 5'):
            ("data.custom_cls.path", "item 0: column 'prompt' (data.prompt_key) is neither"),
    }
    for n, (source, (key, words)) in enumerate(cases.items()):
        cls_file = tmp_path / f"bad{n}.py"
        cls_file.write_text(source)
        cfg = _cfg(model_dir, *base, f"data.custom_cls.path={cls_file}",
                   "data.custom_cls.name=InstructedDataset")
        with pytest.raises(ConfigError) as err:
            records_for(cfg, "train")
        assert err.value.key == key and words in err.value.message, (source, err.value)
    with pytest.raises(ConfigError) as err:
        _cfg(model_dir, f"data.custom_cls.path={tmp_path / 'x.py'}", "data.custom_cls.name=X")
    assert err.value.key == "data.custom_cls.path" and "neither is set" in err.value.message


# The ReTool recipe's shape: verl's RLHFDataset reads the files, the subclass maps each row.
RECIPE_CLASS = '''
from verl.utils.dataset import RLHFDataset

SUFFIX = " Answer with digits."


class CustomRLHFDataset(RLHFDataset):
    def _read_files_and_tokenize(self):
        super()._read_files_and_tokenize()
        self.dataframe = self.dataframe.map(self.map_fn)

    def map_fn(self, row):
        row["prompt"][-1]["content"] += SUFFIX
        row["agent_name"] = "single_turn_agent"
        return row
'''

READ = '''
import json, sys
from runconfig import load_config
from tasks.verl_data import records_for
cfg = load_config(None, sys.argv[1:])
print(json.dumps([[r.text, r.ground_truth, r.agent_name] for r in records_for(cfg, "train")]))
'''


@pytest.mark.procs
def test_a_subclass_of_verls_rlhf_dataset_runs_on_verl(tmp_path: Path, model_dir: Path) -> None:
    if not (VERL_SITE / "verl").is_dir():
        pytest.skip("verl is not installed in .venv/verl-site (make test installs it)")
    data, rows = _data(tmp_path)
    cls_file = tmp_path / "retool_like.py"
    cls_file.write_text(RECIPE_CLASS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(VERL_SITE), str(ROOT)]),
           "HF_DATASETS_CACHE": str(tmp_path / "hf-cache"), "HF_HUB_OFFLINE": "1"}
    line = ["model.kind=hf", f"model.path={model_dir}", f"data.train_files={data}",
            f"custom_reward_function.path={model_dir / 'reward.py'}", "data.shuffle=false",
            f"data.custom_cls.path={cls_file}", "data.custom_cls.name=CustomRLHFDataset"]
    res = subprocess.run([sys.executable, "-c", READ, *line], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    made = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(made) == len(rows)
    for (text, truth, agent), row in zip(made, rows, strict=True):
        content = row["prompt"][-1]["content"]  # type: ignore[index]
        assert f"{content} Answer with digits." in text, text
        assert truth == row["reward_model"]["ground_truth"]  # type: ignore[index]
        assert agent == "single_turn_agent"


@pytest.mark.procs
def test_a_class_importing_modules_of_the_launch_directory_loads_in_the_console_script(
        tmp_path: Path, model_dir: Path) -> None:
    # verl's recipes import their own package from the directory the job starts in
    # (recipe.retool.*): `rlbus config` (the console script, not python -m) finds it too.
    data, _ = _data(tmp_path)
    package = tmp_path / "recipe" / "mine"
    package.mkdir(parents=True)
    (tmp_path / "recipe" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "suffix.py").write_text("SUFFIX = ' Answer with digits.'\n")
    (package / "data.py").write_text(
        "from recipe.mine.suffix import SUFFIX  # noqa: F401\n" + PLAIN_CLASS)
    rlbus = Path(sys.executable).parent / "rlbus"
    res = subprocess.run(
        [str(rlbus), "config", "--show", "data.custom_cls.name", "model.kind=hf",
         f"model.path={model_dir}", f"data.train_files={data}",
         f"custom_reward_function.path={model_dir / 'reward.py'}",
         "data.custom_cls.path=recipe/mine/data.py", "data.custom_cls.name=InstructedDataset"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout == "InstructedDataset\n"
