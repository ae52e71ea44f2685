"""verl-format data (tasks.verl_data): files read as verl's RLHFDataset reads them, the chat
template applied without a second BOS, truncation and the overlong filter, verl's sampler
order with resumes and epochs, and bad files refused before anything starts (exit 2 naming
the key, the file and the column). A tiny Qwen2-architecture model with its own tokenizer and
chat template is built once for the module (tasks.chatdemo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from policy.text import HFTokenizer, build_tokenizer
from runconfig import Config, ConfigError, load_config
from tasks import PromptSource, build_prompt_source
from tasks.chatdemo import DATA_SOURCE, REWARD_FILE, TEMPLATES, build_model, write_parquet
from tasks.chatdemo import build_tokenizer as build_bpe
from tasks.chatdemo import records as demo_records
from tasks.verl_data import (
    VerlPrompts,
    VerlRecord,
    check_data,
    load_records,
    records_for,
    truncate,
)

ROOT = Path(__file__).resolve().parents[1]
RLBUS = [sys.executable, "-m", "rlbus"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2, with the demo's reward file beside it (the records' data source has
    no built-in scorer: a run of them names a reward function, as in verl)."""
    path = build_model(tmp_path_factory.mktemp("model") / "model")
    (path / "reward.py").write_text(REWARD_FILE)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> HFTokenizer:
    return HFTokenizer(model_dir)


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The demo's tokenizer, but one whose chat template writes the BOS token and whose
    encode(add_special_tokens=True) adds it too (as Llama's): the double-BOS trap."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("bos")
    tok = build_bpe(path)
    bos = "<|endoftext|>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.convert_tokens_to_ids(bos))])
    tok.bos_token = bos
    tok.chat_template = "{{ bos_token }}" + TEMPLATES["qwen2"].template
    tok.save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _cfg(model_dir: Path, *overrides: str) -> Config:
    return load_config(None, ["model.kind=hf", f"model.path={model_dir}",
                              f"custom_reward_function.path={model_dir / 'reward.py'}",
                              *overrides])


def _rows(n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    return demo_records(n, split, seed)


def _jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _long_row(words: int) -> dict[str, Any]:
    row = _rows(1)[0]
    row["prompt"] = [{"role": "user", "content": "Reverse " + " ".join(["1234"] * words)}]
    return row


# ---------------------------------------------------------------------------- truncation


def test_truncate_modes_as_verl() -> None:
    ids = list(range(10))
    assert truncate(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate(ids, 4, "middle") == [0, 1, 8, 9]
    assert truncate(ids, 5, "middle") == [0, 1, 7, 8, 9]  # max//2 first, the rest last
    assert truncate(ids, 1, "middle") == [9]
    for mode in ("left", "right", "middle", "error"):
        assert truncate(ids, 10, mode) == ids  # not longer: unchanged
    with pytest.raises(ValueError, match="10 tokens is longer than 9"):
        truncate(ids, 9, "error")


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_applied_to_loaded_prompts(tmp_path: Path, model_dir: Path,
                                              tokenizer: HFTokenizer, mode: str) -> None:
    path = write_parquet([_rows(1)[0], _long_row(30)], tmp_path / "d.parquet")
    full = load_records(str(path), _cfg(model_dir).data, tokenizer, split="train")
    cut = load_records(str(path), _cfg(model_dir, "data.max_prompt_length=20",
                                       f"data.truncation={mode}").data, tokenizer, split="train")
    assert len(full[1].prompt_ids) > 20
    assert cut[1].prompt_ids == truncate(full[1].prompt_ids, 20, mode)
    assert cut[1].text == full[1].text  # the rendered prompt, before truncation
    assert cut[0].prompt_ids == full[0].prompt_ids  # short prompts are kept whole


def test_truncation_error_names_file_and_row(tmp_path: Path, model_dir: Path) -> None:
    path = write_parquet([_rows(1)[0], _long_row(30)], tmp_path / "long.parquet")
    cfg = _cfg(model_dir, f"data.train_files={path}", "data.max_prompt_length=20")
    with pytest.raises(ConfigError) as err:
        check_data(cfg)
    assert err.value.key == "data.train_files"
    assert str(path) in err.value.message and "row 1" in err.value.message
    assert "data.max_prompt_length=20" in err.value.message


def test_filter_overlong_drops_at_load(tmp_path: Path, model_dir: Path,
                                       tokenizer: HFTokenizer) -> None:
    rows = [_rows(1)[0], _long_row(30), _rows(2)[1], _long_row(40)]
    path = write_parquet(rows, tmp_path / "d.parquet")
    cfg = _cfg(model_dir, "data.max_prompt_length=20", "data.filter_overlong_prompts=true")
    recs = load_records(str(path), cfg.data, tokenizer, split="train")  # error mode: no error
    assert [r.ground_truth for r in recs] == [rows[0]["reward_model"]["ground_truth"],
                                              rows[2]["reward_model"]["ground_truth"]]
    assert [r.index for r in recs] == [0, 1]
    only_long = write_parquet([_long_row(30)], tmp_path / "long.parquet")
    with pytest.raises(ConfigError, match="dropped them all"):
        load_records(str(only_long), cfg.data, tokenizer, split="train")


# ---------------------------------------------------------------------------- chat template


def test_chat_template_applied_without_double_bos(tmp_path: Path, model_dir: Path,
                                                  bos_tokenizer: Any) -> None:
    bos = bos_tokenizer.bos_token_id
    rows = _rows(3)
    path = write_parquet(rows, tmp_path / "d.parquet")
    recs = load_records([str(path)], _cfg(model_dir).data, bos_tokenizer, split="train")
    for row, rec in zip(rows, recs, strict=True):
        text = bos_tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                 tokenize=False)
        assert rec.text == text and text.startswith("<|endoftext|><|im_start|>user\n")
        assert rec.text.endswith("<|im_start|>assistant\n")
        assert rec.prompt_ids[0] == bos and rec.prompt_ids[1] != bos  # one BOS, the template's
        assert rec.prompt_ids == bos_tokenizer.encode(text, add_special_tokens=False)
        # The trap this avoids: encoding the rendered text with special tokens doubles it.
        assert bos_tokenizer.encode(text)[:2] == [bos, bos]


def test_chat_template_kwargs_passed_through(tmp_path: Path, model_dir: Path,
                                             tokenizer: HFTokenizer) -> None:
    path = write_parquet(_rows(1), tmp_path / "d.parquet")
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ suffix }}"
    cfg = load_config(None, [
        "model.kind=hf", f"model.path={model_dir}",
        f"data.apply_chat_template_kwargs={json.dumps({'chat_template': template, 'suffix': '>'})}",
    ])
    rec = load_records(str(path), cfg.data, tokenizer, split="train")[0]
    assert rec.text == f"[{_rows(1)[0]['prompt'][0]['content']}]>"


def test_string_prompt_is_one_user_message(tmp_path: Path, model_dir: Path,
                                           tokenizer: HFTokenizer) -> None:
    row = _rows(1)[0]
    as_chat = load_records(str(write_parquet([row], tmp_path / "chat.parquet")),
                           _cfg(model_dir).data, tokenizer, split="train")[0]
    row = {**row, "prompt": row["prompt"][0]["content"]}
    as_text = load_records(str(_jsonl([row], tmp_path / "text.jsonl")),
                           _cfg(model_dir).data, tokenizer, split="train")[0]
    assert as_text.text == as_chat.text == (
        f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    assert as_text.prompt_ids == as_chat.prompt_ids


def test_jsonl_json_and_parquet_give_the_same_records(tmp_path: Path, model_dir: Path,
                                                      tokenizer: HFTokenizer) -> None:
    rows = _rows(12)
    data = _cfg(model_dir).data
    from_parquet = load_records(str(write_parquet(rows, tmp_path / "d.parquet")), data,
                                tokenizer, split="train")
    from_jsonl = load_records(str(_jsonl(rows, tmp_path / "d.jsonl")), data, tokenizer,
                              split="train")
    array = tmp_path / "d.json"
    array.write_text(json.dumps(rows))
    from_json = load_records(str(array), data, tokenizer, split="train")
    assert from_parquet == from_jsonl == from_json
    r = from_parquet[3]
    assert (r.data_source, r.ground_truth, r.extra_info) == (
        DATA_SOURCE, rows[3]["reward_model"]["ground_truth"], rows[3]["extra_info"])
    # Several files: one list, in order.
    both = load_records([str(tmp_path / "d.parquet"), str(tmp_path / "d.jsonl")], data,
                        tokenizer, split="train")
    assert [x.ground_truth for x in both] == [x.ground_truth for x in from_parquet] * 2
    assert [x.index for x in both] == list(range(24))


# ---------------------------------------------------------------------------- order


def _fake(n: int) -> list[VerlRecord]:
    return [VerlRecord(i, [i], f"prompt {i}", "src", str(i), {"index": i}) for i in range(n)]


def test_shuffle_is_verls_sampler_order_and_deterministic() -> None:
    import torch
    from torch.utils.data import RandomSampler

    n = 23
    g = torch.Generator()
    g.manual_seed(5)
    sampler = RandomSampler(range(n), generator=g)  # what verl's stateful sampler wraps
    verl_order = [i for _ in range(3) for i in sampler]
    src = VerlPrompts(_fake(n), shuffle=True, seed=5)
    assert isinstance(src, PromptSource)
    drawn = [src.next() for _ in range(3 * n)]
    assert [int(p.ground_truth) for p in drawn] == verl_order
    for epoch in range(3):  # every prompt once per epoch
        assert sorted(int(p.ground_truth) for p in drawn[epoch * n:(epoch + 1) * n]) == \
            list(range(n))
    assert [p.prompt_id for p in drawn[:2]] == ["p0", "p1"]
    assert [src.get(i) for i in range(3 * n)] == drawn  # get is pure, in any order
    assert [src.get(i) for i in reversed(range(3 * n))] == drawn[::-1]
    other = VerlPrompts(_fake(n), shuffle=True, seed=6)
    assert [other.get(i).ground_truth for i in range(n)] != [p.ground_truth for p in drawn[:n]]
    plain = VerlPrompts(_fake(n), shuffle=False)
    assert [int(plain.get(i).ground_truth) for i in range(2 * n)] == list(range(n)) * 2


def test_epoch_batches_are_verls_drop_last_dataloader_batches() -> None:
    """A classic line's epochs (data.epoch_batch_size, set by data.train_batch_size): the
    batches verl's dataloader gives (drop_last=True over its RandomSampler), epoch after
    epoch; the last partial batch of each epoch is never drawn."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    n, batch, epochs = 23, 4, 3
    g = torch.Generator()
    g.manual_seed(5)
    loader = DataLoader(list(range(n)), batch_size=batch, drop_last=True,
                        sampler=RandomSampler(range(n), generator=g))
    verl_batches = [b.tolist() for _ in range(epochs) for b in loader]
    src = VerlPrompts(_fake(n), shuffle=True, seed=5, epochs=epochs, epoch_batch=batch)
    assert len(src) == 20 and src.limit == 60
    drawn = [int(src.next().ground_truth) for _ in range(src.limit)]
    assert [drawn[i:i + batch] for i in range(0, len(drawn), batch)] == verl_batches
    with pytest.raises(IndexError, match="3 epoch"):
        src.get(60)
    assert len(VerlPrompts(_fake(n), epoch_batch=0)) == n  # a fully-async line: every record
    with pytest.raises(ValueError, match="no batch of 24"):
        VerlPrompts(_fake(n), epoch_batch=24)


def test_resume_from_index_continues_the_epoch() -> None:
    n, k = 17, 25
    first = VerlPrompts(_fake(n), seed=3)
    whole = [first.next() for _ in range(3 * n)]
    resumed = VerlPrompts(_fake(n), seed=3)
    resumed.index = k  # a restarted trainer: the tickets its log records
    assert [resumed.next() for _ in range(3 * n - k)] == whole[k:]
    epoch = [p.ground_truth for p in whole[n:2 * n]]
    assert len(set(epoch)) == n  # the resumed epoch repeats nothing


def test_prompt_carries_the_record() -> None:
    src = VerlPrompts(_fake(4), shuffle=False)
    p = src.get(5)
    assert p.prompt_id == "p5" and p.prompt == "prompt 1" and p.prompt_ids == [1]
    assert (p.data_source, p.ground_truth, p.answer, p.extra_info) == ("src", "1", "1",
                                                                      {"index": 1})
    p.prompt_ids.append(99)  # a copy: the records stay as loaded
    assert src.get(5).prompt_ids == [1]


def test_total_epochs_ends_the_source(tmp_path: Path, model_dir: Path) -> None:
    src = VerlPrompts(_fake(5), seed=1, epochs=2)
    assert src.limit == 10 and len(src) == 5
    assert len({src.get(i).ground_truth for i in range(5, 10)}) == 5
    with pytest.raises(IndexError, match="2 epoch"):
        src.get(10)
    assert VerlPrompts(_fake(5), epochs=None).limit is None
    path = write_parquet(_rows(40), tmp_path / "d.parquet")
    base = [f"data.train_files={path}", "trainer.ppo_mini_batch_size=4",
            "async_training.require_batches=2"]
    # 2 epochs of 40 prompts: 80 prompts, 10 steps of 8.
    check_data(_cfg(model_dir, *base, "trainer.total_epochs=2", "trainer.total_training_steps=10"))
    with pytest.raises(ConfigError) as err:
        check_data(_cfg(model_dir, *base, "trainer.total_epochs=2",
                        "trainer.total_training_steps=11"))
    assert err.value.key == "trainer.total_epochs" and "10 steps" in err.value.message
    check_data(_cfg(model_dir, *base, "trainer.total_training_steps=1000"))  # null: cycles


def test_max_samples_as_verl(tmp_path: Path, model_dir: Path, tokenizer: HFTokenizer) -> None:
    import numpy as np

    rows = _rows(30)
    path = str(write_parquet(rows, tmp_path / "d.parquet"))
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    cfg = _cfg(model_dir, "data.train_max_samples=7", "data.seed=4")
    picked = np.random.default_rng(4).choice(30, size=7, replace=False)
    got = load_records(path, cfg.data, tokenizer, split="train")
    assert [r.ground_truth for r in got] == [truths[int(i)] for i in picked]
    cfg = _cfg(model_dir, "data.train_max_samples=7", "data.shuffle=false")
    assert [r.ground_truth for r in load_records(path, cfg.data, tokenizer, split="train")] \
        == truths[:7]
    cfg = _cfg(model_dir, "data.val_max_samples=3", "data.shuffle=false")
    assert len(load_records(path, cfg.data, tokenizer, split="val")) == 3
    assert len(load_records(path, cfg.data, tokenizer, split="train")) == 30


# ---------------------------------------------------------------------------- the run


def test_run_config_builds_the_source_and_tickets(tmp_path: Path, model_dir: Path) -> None:
    from trainer.dispatch import Dispatch

    train = write_parquet(_rows(10), tmp_path / "train.parquet")
    other = [{**r, "data_source": "other"} for r in _rows(3, "test", 1)]
    val = _jsonl(other, tmp_path / "val.jsonl")
    cfg = _cfg(model_dir, f"data.train_files={train}", f"data.val_files=[{val}]",
               "rollout.n=2")
    assert check_data(cfg) == {DATA_SOURCE, "other"}
    assert [r.data_source for r in records_for(cfg, "val")] == ["other"] * 3
    src = build_prompt_source(cfg)
    assert isinstance(src, VerlPrompts) and len(src) == 10
    ticket = Dispatch(cfg, src, dlq="dlq").ticket(12, 2, 0)
    p = src.get(12)
    assert ticket.prompt_ids == p.prompt_ids and ticket.prompt == p.prompt
    assert ticket.data_source == DATA_SOURCE and ticket.ground_truth == p.ground_truth
    assert ticket.answer == str(p.ground_truth) and ticket.extra_info == p.extra_info
    # The built-in task still comes from task.* without data files.
    digits = build_prompt_source(load_config(None, ["task.seed=3"]))
    assert digits.get(0).prompt_ids is None and digits.get(0).prompt.endswith(">")


def test_hf_tokenizer_knows_every_eos(model_dir: Path, tokenizer: HFTokenizer) -> None:
    im_end, eot = tokenizer.hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.eos_ids == [im_end, eot] and tokenizer.eos_id == im_end
    ids = tokenizer.encode("4321")
    assert tokenizer.decode([*ids, eot, *ids]) == "4321"
    assert tokenizer.decode([*ids, im_end, *ids]) == "4321"
    assert isinstance(build_tokenizer(_cfg(model_dir).model), HFTokenizer)


# ---------------------------------------------------------------------------- refusals


def _refused(cfg: Config) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        check_data(cfg)
    return err.value


def test_bad_files_are_refused_naming_file_and_column(tmp_path: Path, model_dir: Path) -> None:
    def refused(path: Path | str, *more: str) -> ConfigError:
        return _refused(_cfg(model_dir, f"data.train_files={path}", *more))

    missing = tmp_path / "nope.parquet"
    err = refused(missing)
    assert err.key == "data.train_files" and str(missing) in err.message
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    assert "unsupported file format" in refused(csv).message
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    assert str(garbage) in refused(garbage).message
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(_rows(1)[0]) + "\n{oops\n")
    assert "line 2" in refused(bad_json).message
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "no records" in refused(empty).message

    rows = _rows(3)
    no_source = write_parquet([{k: v for k, v in r.items() if k != "data_source"} for r in rows],
                              tmp_path / "no_source.parquet")
    err = refused(no_source)
    assert str(no_source) in err.message and "'data_source'" in err.message
    err = refused(write_parquet(rows, tmp_path / "key.parquet"), "data.prompt_key=question")
    assert "'question'" in err.message and "data.prompt_key" in err.message
    no_truth = [{**r, "reward_model": {"style": "rule"}} for r in rows]
    err = refused(write_parquet(no_truth, tmp_path / "no_truth.parquet"))
    assert "ground_truth" in err.message
    bad_prompt = [rows[0], {**rows[1], "prompt": 42}]
    err = refused(_jsonl(bad_prompt, tmp_path / "bad_prompt.jsonl"))
    assert "bad_prompt.jsonl: line 2" in err.message and "'prompt'" in err.message
    # A multi-modal record (verl's "images" column, geo3k's layout) is refused: the job would
    # train on its text alone. An empty images list is text-only.
    text_only = [{**r, "images": []} for r in rows]
    assert check_data(_cfg(model_dir, "data.train_files="
                           f"{write_parquet(text_only, tmp_path / 'text.parquet')}")) is not None
    pictures = [*text_only[:2], {**rows[2], "images": [{"bytes": b"\x89PNG"}]}]
    err = refused(write_parquet(pictures, tmp_path / "geo.parquet"))
    assert "geo.parquet: row 2 carries 'images'" in err.message, err.message
    # A val file is named as such, after a good train file.
    good = write_parquet(rows, tmp_path / "good.parquet")
    err = _refused(_cfg(model_dir, f"data.train_files={good}", f"data.val_files={no_source}"))
    assert err.key == "data.val_files" and str(no_source) in err.message


def test_conflicts_and_models_without_a_chat_template(tmp_path: Path, model_dir: Path) -> None:
    path = write_parquet(_rows(2), tmp_path / "d.parquet")
    err = _refused(_cfg(model_dir, f"data.train_files={path}", "task.kind=jsonl",
                        f"task.path={tmp_path / 'p.jsonl'}"))
    assert err.key == "task.kind"
    err = _refused(load_config(None, [f"data.train_files={path}"]))  # the tiny char model
    assert err.key == "data.train_files" and "chat template" in err.message
    assert check_data(load_config(None, [])) == set()


def _no_column_file(tmp_path: Path) -> Path:
    rows = [{k: v for k, v in r.items() if k != "data_source"} for r in _rows(3)]
    return write_parquet(rows, tmp_path / "no_source.parquet")


@pytest.mark.procs
@pytest.mark.parametrize("command", [["config"], ["up"],
                                     ["trainer", "redis.url=redis://127.0.0.1:1/0",
                                      "run.id=r1"]])
def test_commands_exit_2_on_a_missing_column(tmp_path: Path, model_dir: Path,
                                             command: list[str]) -> None:
    bad = _no_column_file(tmp_path)
    out = tmp_path / "out"
    res = subprocess.run(
        [*RLBUS, *command, "model.kind=hf", f"model.path={model_dir}",
         f"data.train_files={bad}", f"run.output_dir={out}"],
        capture_output=True, text=True, cwd=ROOT, check=False)
    assert res.returncode == 2, res.stderr
    assert "error: invalid config key 'data.train_files'" in res.stderr
    assert str(bad) in res.stderr and "'data_source'" in res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists()  # nothing started, nothing written


# ---------------------------------------------------------------------------- end to end


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_trainer_and_rollouter_run_on_verl_data(
    redis_url: str, bus: Any, run_id: str, run_keys: Any, tmp_path: Path, model_dir: Path
) -> None:
    """Two epochs of 8 chat prompts make exactly the run's 4 steps of 4 prompts: every
    ticket carries its record, the rollouter generates from its token ids as given, each
    epoch visits every prompt once, and nothing is issued past the data's end."""
    from runschema.messages import RunFinished, Sample, StepFinished, TicketsIssued
    from tests.procs import FAST, events_of, run_rollouter_and_trainer

    rows = _rows(8)
    train = write_parquet(rows, tmp_path / "train.parquet")
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}", *FAST,
            "model.kind=hf", f"model.path={model_dir}", f"data.train_files={train}",
            f"custom_reward_function.path={model_dir / 'reward.py'}", "trainer.total_epochs=2",
            "trainer.total_training_steps=4",
            "async_training.staleness_threshold=1"]
    run_rollouter_and_trainer(tmp_path / "logs", args)
    events = await events_of(bus, run_keys.events)
    assert [e.step for e in events if isinstance(e, StepFinished)] == [1, 2, 3, 4]
    assert any(isinstance(e, RunFinished) for e in events)
    issued = [tid for e in events if isinstance(e, TicketsIssued) for tid in e.ticket_ids]
    assert sorted(set(issued), key=lambda t: int(t[1:])) == [f"t{i}" for i in range(16)]
    # The trainer's prompts, as the same config draws them: ticket t{i} is prompt i.
    src = build_prompt_source(load_config(None, args))
    trained = {sid.split("/")[0] for e in events if isinstance(e, StepFinished)
               for sid in e.sample_ids}
    assert trained == {f"t{i}" for i in range(16)}  # 16 prompts, 16 trained: none left out
    samples = [m async for _, m in bus.read_all(run_keys.samples) if isinstance(m, Sample)]
    by_ticket = {s.ticket_id: s for s in samples}
    assert by_ticket
    for tid, s in by_ticket.items():
        p = src.get(int(tid[1:]))
        # Generated from the ticket's token ids as given: chat template, no BOS added.
        assert s.prompt_tokens.numpy().tolist() == p.prompt_ids
        assert p.prompt.startswith("<|im_start|>user") and p.data_source == DATA_SOURCE
    truths = sorted(r["reward_model"]["ground_truth"] for r in rows)
    for epoch in range(2):  # each prompt once per epoch
        assert sorted(src.get(i).ground_truth for i in range(8 * epoch, 8 * epoch + 8)) == truths


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_resumed_trainer_continues_the_epoch(
    redis_url: str, bus: Any, run_id: str, run_keys: Any, tmp_path: Path, model_dir: Path
) -> None:
    """The trainer is killed after step 3 (checkpoint at step 2) and resumed: the run's
    four epochs of 16 records still train each record exactly once per epoch (no prompt
    twice in an epoch, none left out) and nothing past the data."""
    from runschema.messages import StepFinished, TrainerResumed
    from tests.procs import FAST, Procs, events_of
    from tests.waits import event, wait_for

    rows = _rows(16)
    train = write_parquet(rows, tmp_path / "train.parquet")
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}", *FAST,
            "model.kind=hf", f"model.path={model_dir}", f"data.train_files={train}",
            f"custom_reward_function.path={model_dir / 'reward.py'}", "trainer.total_epochs=4",
            "trainer.total_training_steps=16", "trainer.save_freq=2",
            "async_training.staleness_threshold=1"]
    procs = Procs(tmp_path / "logs")
    try:
        procs.spawn("rollouter0", "rollouter", *args)
        procs.spawn("trainer", "trainer", *args)
        await wait_for(bus, run_keys.events, event(StepFinished, step=3), 300,
                       procs.watch("trainer", "rollouter0"))
        procs.kill("trainer")
        procs.spawn("trainer2", "trainer", *args)
        assert procs.wait("trainer2", 300) == 0, procs.log("trainer2")
        assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    finally:
        procs.kill_all()
    events = await events_of(bus, run_keys.events)
    (resumed,) = [e for e in events if isinstance(e, TrainerResumed)]
    assert resumed.checkpoint_step < 16, resumed  # resumed mid-run, not at the end
    finished = [e for e in events if isinstance(e, StepFinished)]
    assert sorted({e.step for e in finished}) == list(range(1, 17))
    # The steps the log kept (a step re-done after the kill replaces nothing it finished).
    trained = {int(sid.split("/")[0][1:]) for e in finished for sid in e.sample_ids}
    assert trained == set(range(64))
    src = build_prompt_source(load_config(None, args))
    truths = sorted(r["reward_model"]["ground_truth"] for r in rows)
    for epoch in range(4):
        assert sorted(src.get(i).ground_truth for i in range(16 * epoch, 16 * epoch + 16)) == (
            truths)
