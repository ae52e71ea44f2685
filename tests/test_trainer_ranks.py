"""Trainer ranks (trainer.nnodes x n_gpus_per_node, gloo on CPU): 2 ranks train what 1 rank
trains, FSDP2 and ddp; a checkpoint written by 2 ranks resumes with 1 and with 2; a rank
killed mid-run fails the trainer naming it, and the run resumes with the weights it had.

Equality is to float tolerance, not bitwise: each rank sums its rows' token-weighted loss
and the ranks' gradients are summed (FSDP2's reduce-scatter, ddp's all_reduce), so the
gradient is added in a different order than one rank's backward over all rows."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from rlbus.redis_binary import free_port
from runconfig import ConfigError, load_config
from tests.procs import FAST, run_cli
from tests.test_supervise import Up

HARNESS = str(Path(__file__).with_name("ranks_harness.py"))
# Adam divides by the gradient's scale: a 1e-7 difference in a tiny gradient moves a weight
# by up to ~lr; after 3 steps at lr 0.01 the ranks' weights agree to < 1e-3 (7.6e-5 seen).
WEIGHTS_TOL = 1e-3


def _harness(out: Path, *args: str) -> dict[str, Any]:
    res = subprocess.run([sys.executable, HARNESS, str(out), *args], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    loaded: dict[str, Any] = torch.load(out, weights_only=False)
    return loaded


def _max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _harness(tmp_path_factory.mktemp("r1") / "r1.pt", "trainer.n_gpus_per_node=1")


SEQLEN = ["global_seqlen/min", "global_seqlen/max", "global_seqlen/minmax_diff",
          "global_seqlen/balanced_min", "global_seqlen/balanced_max", "global_seqlen/mean"]


# fsdp2 with trainer.balance_batch (the default: rows split by tokens), ddp without it.
@pytest.mark.procs
@pytest.mark.parametrize(("strategy", "balance"), [("fsdp2", True), ("ddp", False)])
def test_two_ranks_train_what_one_rank_trains(one_rank: dict[str, Any], strategy: str,
                                              balance: bool, tmp_path: Path) -> None:
    two = _harness(tmp_path / "r2.pt", "trainer.n_gpus_per_node=2",
                   f"trainer.strategy={strategy}", f"trainer.balance_batch={balance}")
    assert _max_gap(one_rank["model"], two["model"]) < WEIGHTS_TOL
    assert _max_gap(one_rank["snapshot"], two["snapshot"]) < WEIGHTS_TOL
    # The same checkpoint format: index-keyed optimizer state, the lr schedule inside.
    assert sorted(two["optimizer"]["state"]) == sorted(one_rank["optimizer"]["state"])
    assert "lr_scheduler" in two["optimizer"]
    for m1, m2 in zip(one_rank["metrics"], two["metrics"], strict=True):
        assert sorted(m2) == sorted([*m1, *(SEQLEN if balance else [])])
        if balance:  # verl's: tokens per rank, split strided vs balanced
            assert m2["global_seqlen/balanced_max"] <= m2["global_seqlen/max"]
            assert m2["global_seqlen/balanced_min"] >= m2["global_seqlen/min"]
            assert m2["global_seqlen/balanced_max"] >= m2["global_seqlen/mean"]
        for key in m1:  # losses, entropies, KL, probs diff: reduced over the ranks
            assert m2[key] == pytest.approx(m1[key], rel=1e-3, abs=1e-4), key
    # The last step had stale samples (decoupled PPO): its metrics differ from the first's.
    assert two["metrics"][-1]["staleness/max"] == 1.0


@pytest.mark.procs
@pytest.mark.parametrize("extra", [
    # 8 rows: ranks of 4 rows in 2 micro-batches each; the KL loss, the guard (its KL
    # reduced over the ranks), zero_adv drop and a second epoch on top.
    ["trainer.micro_batch_size=3", "trainer.use_kl_loss=true", "trainer.kl_loss_coef=0.5",
     "trainer.kl_guard=0.05", "trainer.zero_adv=drop", "trainer.ppo_epochs=2"],
    ["trainer.use_dynamic_bsz=true", "trainer.max_token_len=12"],  # uneven micro counts
    # verl's rejection sampling: the kept tokens counted over the ranks (one all-reduce).
    ["trainer.rollout_rs=seq_mean_k1", "trainer.rollout_rs_threshold=0.30_3.0",
     "trainer.micro_batch_size=3", "trainer.tis_cap=2.0"],
], ids=["micro_kl_guard_epochs", "dynamic_bsz", "rejection_sampling"])
def test_two_ranks_match_one_with_micro_batches_kl_and_epochs(extra: list[str],
                                                               tmp_path: Path) -> None:
    one = _harness(tmp_path / "one.pt", "trainer.n_gpus_per_node=1", *extra)
    two = _harness(tmp_path / "two.pt", "trainer.n_gpus_per_node=2", *extra)
    assert _max_gap(one["model"], two["model"]) < WEIGHTS_TOL
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        for key in m1:
            assert m2[key] == pytest.approx(m1[key], rel=1e-3, abs=1e-4), key


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2 with tied embeddings (the ranks' FSDP2 units are its decoder
    layers)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("qwen2")
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def _hf_keys(model: Path) -> list[str]:
    return ["run.defaults=rlbus", "rollout.max_new_tokens=16", "model.kind=hf",
            f"model.path={model}"]


@pytest.fixture(scope="module")
def hf_one_rank(hf_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, dict[str, Any]]:
    """One rank of the HF model, in float32 and in bf16 (autocast)."""
    out = tmp_path_factory.mktemp("hf1")
    return {dtype: _harness(out / f"{dtype}.pt", "trainer.n_gpus_per_node=1",
                            *_hf_keys(hf_model), f"model.dtype={dtype}")
            for dtype in ("fp32", "bf16")}


def _mean_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return (sum(float((a[k].float() - b[k].float()).abs().sum()) for k in a)
            / sum(a[k].numel() for k in a))


# bf16 compute (model.dtype=bf16, so fsdp_param_dtype auto is bf16): one rank runs in
# autocast, two ranks in FSDP2's MixedPrecisionPolicy (bf16 all-gathers: embeddings and norms
# in bf16 too, as verl's FSDP runs) or ddp (autocast); gradients summed in float32 (the
# default) or bf16 (verl's mixed_precision.reduce_dtype).
@pytest.mark.procs
@pytest.mark.parametrize(("strategy", "reduce"), [("fsdp2", "fp32"), ("fsdp2", "bf16"),
                                                  ("ddp", "bf16")])
def test_two_ranks_in_bf16_train_what_one_rank_trains(
        hf_model: Path, hf_one_rank: dict[str, dict[str, Any]], strategy: str, reduce: str,
        tmp_path: Path) -> None:
    two = _harness(tmp_path / "two.pt", "trainer.n_gpus_per_node=2", *_hf_keys(hf_model),
                   "model.dtype=bf16", f"trainer.strategy={strategy}",
                   f"actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype={reduce}")
    fp32, one = hf_one_rank["fp32"], hf_one_rank["bf16"]
    assert one["mixed_precision"] is None
    reduced = "torch.float32" if reduce == "fp32" else "torch.bfloat16"
    assert two["mixed_precision"] == (("torch.bfloat16", reduced) if strategy == "fsdp2"
                                      else None)
    assert {t.dtype for t in two["model"].values()} == {torch.float32}  # master weights
    # Published in bf16 (rollout.weights_dtype auto), each tensor cast as it was gathered;
    # the tied head is the embedding, published once.
    snap = two["snapshot"]
    assert {t.dtype for t in snap.values()} == {torch.bfloat16}
    for published in (snap, one["snapshot"]):
        assert (published["lm_head.weight"].data_ptr()
                == published["model.embed_tokens.weight"].data_ptr())
    for name, t in snap.items():  # the master weights, rounded once
        assert torch.equal(t, two["model"][f"model.{name}"].to(torch.bfloat16)), name
    # Adam moves a weight by ~lr whatever its gradient's size, so bf16 rounding that flips a
    # tiny gradient's sign shows up in single weights: compare the mean gap, which must stay
    # within what bf16 itself does to one rank (measured: 1.5e-3 and 3e-4 against 1.3e-3).
    assert _mean_gap(one["model"], two["model"]) < 2 * _mean_gap(fp32["model"], one["model"])
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        for key in ("actor/grad_norm", "actor/entropy", "actor/loss"):
            assert m2[key] == pytest.approx(m1[key], rel=0.02, abs=1e-3), key


@pytest.mark.procs
@pytest.mark.parametrize("fmt", ["dcp", "full"])
def test_a_checkpoint_of_two_ranks_resumes_with_one_and_with_two(
        one_rank: dict[str, Any], tmp_path: Path, fmt: str) -> None:
    """dcp: each rank writes its shard (step-K.dcp beside step-K.pt, which names it); full:
    rank 0 writes every tensor whole into step-K.pt. Either resumes with 1 rank or with 2."""
    two = tmp_path / "two.pt"
    _harness(two, "trainer.n_gpus_per_node=2", f"trainer.checkpoint_format={fmt}")
    ckpt = Path(f"{two}.ckpt") / "step-000002.pt"
    index = torch.load(ckpt, weights_only=True)
    shards = sorted(p.name for p in ckpt.with_suffix(".dcp").glob("*.distcp"))
    if fmt == "dcp":
        assert index["format"] == "dcp" and "model" not in index
        assert shards == ["__0_0.distcp", "__1_0.distcp"], shards  # one per rank
    else:
        assert "model" in index and shards == []
    # dcp reshards to 1 rank and to 2. full is the one-rank format (one rank loads it as it
    # always did); with 2 ranks rank 0 reads it and scatters it.
    for ranks in ((1, 2) if fmt == "dcp" else (2,)):
        resumed = _harness(tmp_path / f"resumed{ranks}.pt", "--resume", str(ckpt),
                           f"trainer.n_gpus_per_node={ranks}")
        assert _max_gap(one_rank["model"], resumed["model"]) < WEIGHTS_TOL
        assert resumed["metrics"][0]["actor/loss"] == pytest.approx(
            one_rank["metrics"][-1]["actor/loss"], rel=1e-3, abs=1e-4)
        assert resumed["metrics"][0]["actor/lr"] == one_rank["metrics"][-1]["actor/lr"]


@pytest.mark.procs
def test_a_checkpoint_of_one_rank_resumes_with_two(one_rank: dict[str, Any],
                                                    tmp_path: Path) -> None:
    one = tmp_path / "one.pt"
    _harness(one, "trainer.n_gpus_per_node=1")
    resumed = _harness(tmp_path / "resumed.pt", "--resume",
                       str(Path(f"{one}.ckpt") / "step-000002.pt"), "trainer.n_gpus_per_node=2")
    assert _max_gap(one_rank["model"], resumed["model"]) < WEIGHTS_TOL


@pytest.mark.parametrize(("args", "key"), [
    (["trainer.n_gpus_per_node=64", "trainer.ppo_mini_batch_size=2", "rollout.n=4"],
     "trainer.n_gpus_per_node"),
    (["trainer.nnodes=2"], "trainer.master_port"),
    (["trainer.node_rank=1"], "trainer.node_rank"),
    (["trainer.fsdp_param_dtype=bf16"], "trainer.fsdp_param_dtype"),  # the built-in model
    (["trainer.fsdp_reduce_dtype=fp16"], "trainer.fsdp_reduce_dtype"),
])
def test_rank_keys_are_checked_before_anything_starts(args: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    assert err.value.key == key


def test_verls_mixed_precision_keys_set_the_trainers_dtypes(hf_model: Path) -> None:
    cfg = load_config(None, [*_hf_keys(hf_model),
                             "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
                             "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=bf16",
                             "actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=fp32"])
    assert (cfg.trainer.fsdp_param_dtype, cfg.trainer.fsdp_reduce_dtype) == ("bf16", "bf16")
    assert cfg.model.dtype == "fp32"  # the rollouter's weights keep model.dtype


def _rank_pids(trainer_pid: int) -> list[int]:
    kids = psutil.Process(trainer_pid).children()
    return [k.pid for k in kids if "trainer.rank" in " ".join(k.cmdline())]


@pytest.mark.procs
def test_a_killed_rank_fails_the_trainer_by_name_and_the_run_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [f"run.output_dir={out}", "run.id=ranks", *FAST, "trainer.logger=[console]",
            "heartbeat.timeout_s=600", "trainer.n_gpus_per_node=2", "trainer.save_freq=2",
            "trainer.total_training_steps=12", "run.retention=checkpoint",
            "trainer.max_actor_ckpt_to_keep=2"]
    first = Up([sys.executable, "-m", "rlbus", "up", *args], tmp_path)
    try:
        line = first.wait_line(lambda s: "trainer (pid " in s)
        trainer_pid = int(line.split("trainer (pid ")[1].split(")")[0])
        first.wait_line(lambda s: s.startswith("step ") and int(s.split()[1].split("/")[0]) >= 3)
        ranks = _rank_pids(trainer_pid)
        assert len(ranks) == 1, ranks  # rank 1, started by the trainer (rank 0)
        os.kill(ranks[0], signal.SIGKILL)
        rc, text = first.finish()
    finally:
        first.kill()
    assert rc == 1, text
    log = (out / "ranks" / "logs" / "trainer.log").read_text()
    assert f"trainer rank 1 (pid {ranks[0]}) exited with code -9" in log, log[-3000:]
    res = run_cli("up", *args, timeout_s=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "finished after 12 steps" in res.stdout, res.stdout
    assert re.search(r"^step +12/12 .* 2 ranks$", res.stdout, re.M), res.stdout  # progress
    inspect = run_cli("inspect", "--run", "ranks", f"run.output_dir={out}", timeout_s=120)
    resumed = [s for s in inspect.stdout.splitlines() if "TrainerResumed" in s]
    assert resumed and "weights_match=True" in resumed[-1], inspect.stdout
    assert any("step=12 " in s and s.endswith(" ranks=2") for s in inspect.stdout.splitlines())
    # Sharded checkpoints (trainer.checkpoint_format auto: dcp with 2 ranks): each step-K.pt
    # names the folder of shards beside it, and retention kept them in pairs.
    ckpts = out / "ranks" / "checkpoints"
    pts = sorted(p.stem for p in ckpts.glob("step-*.pt"))
    assert pts and pts == sorted(p.stem for p in ckpts.glob("step-*.dcp")), list(ckpts.iterdir())


@pytest.mark.procs
def test_profiling_step_1_writes_one_trace_per_trainer_rank(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = run_cli("up", f"run.output_dir={out}", "run.id=prof", *FAST, "trainer.logger=[console]",
                  "trainer.n_gpus_per_node=2", "trainer.total_training_steps=3",
                  "global_profiler.tool=torch", "global_profiler.steps=[1]", timeout_s=600)
    assert res.returncode == 0, res.stdout + res.stderr
    root = out / "profiles" / "prof"
    manifest = json.loads((root / "manifest.json").read_text())
    ok = {(e["role"], e["rank"]) for e in manifest["sessions"] if e["status"] == "ok"}
    assert ok == {("trainer", 0), ("trainer", 1), ("rollouter", 0)}, manifest
    session = root / "sessions" / "s1-1"
    ranks = {}
    for name in ("trainer0", "trainer1", "rollouter0"):
        trace = json.loads(gzip.decompress((session / f"{name}.json.gz").read_bytes()))
        ranks[name] = trace["distributedInfo"]
        assert any(e.get("name") == "step:1" for e in trace["traceEvents"]), name
    # One job for HTA: trainer ranks 0 and 1, then the rollouter, all below world_size 3.
    assert ranks == {"trainer0": {"rank": 0, "world_size": 3},
                     "trainer1": {"rank": 1, "world_size": 3},
                     "rollouter0": {"rank": 2, "world_size": 3}}, ranks


@pytest.mark.procs
def test_a_second_node_joins_with_rlbus_trainer_and_node_rank(tmp_path: Path) -> None:
    """Two "nodes" on one machine: ``rlbus trainer trainer.node_rank=1`` starts node 1's
    rank (no Redis, no run id) and waits for rank 0, which `rlbus up` starts."""
    port = str(free_port())
    nodes = ["trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.master_addr=127.0.0.1",
             f"trainer.master_port={port}"]
    node1 = subprocess.Popen([sys.executable, "-m", "rlbus", "trainer", "trainer.node_rank=1",
                              *nodes], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        res = run_cli("up", f"run.output_dir={tmp_path / 'out'}", "run.id=nodes", *FAST,
                      "trainer.logger=[console]", "trainer.total_training_steps=3", *nodes,
                      timeout_s=600)
        assert res.returncode == 0, res.stdout + res.stderr
        assert re.search(r"^step +3/3 .* 2 ranks$", res.stdout, re.M), res.stdout
        out, _ = node1.communicate(timeout=120)
    finally:
        node1.kill()
    assert node1.returncode == 0, out
    assert f"node 1: ranks 1..1 joining 127.0.0.1:{port}" in out, out


def _two_nodes(tmp_path: Path) -> tuple[subprocess.Popen[str], Up, list[str]]:
    """Two "nodes" on one machine, training: node 1's `rlbus trainer trainer.node_rank=1`
    and `rlbus up` (rank 0), once step 3 is done."""
    port = str(free_port())
    nodes = ["trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.master_addr=127.0.0.1",
             f"trainer.master_port={port}"]
    node1 = subprocess.Popen([sys.executable, "-m", "rlbus", "trainer", "trainer.node_rank=1",
                              *nodes], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    up = Up([sys.executable, "-m", "rlbus", "up", f"run.output_dir={tmp_path / 'out'}",
             "run.id=nodes", *FAST, "trainer.logger=[console]", "heartbeat.timeout_s=600",
             "trainer.total_training_steps=500", *nodes], tmp_path)
    line = up.wait_line(lambda s: "trainer (pid " in s)
    up.wait_line(lambda s: s.startswith("step ") and int(s.split()[1].split("/")[0]) >= 3)
    return node1, up, [line.split("trainer (pid ")[1].split(")")[0]]


@pytest.mark.procs
def test_a_rank_of_another_node_that_dies_is_one_line_and_a_failure_in_the_log(
        tmp_path: Path) -> None:
    node1, up, _ = _two_nodes(tmp_path)
    try:
        (rank1,) = _rank_pids(node1.pid)
        os.kill(rank1, signal.SIGKILL)
        rc, text = up.finish()
    finally:
        up.kill()
        os.killpg(node1.pid, signal.SIGKILL)
        node1.communicate()
    assert rc == 1, text
    log = (tmp_path / "out" / "nodes" / "logs" / "trainer.log").read_text()
    assert "[rank0]" not in log and "Traceback" not in log, log[-3000:]
    said = [s for s in log.splitlines() if "a trainer rank on another node is gone" in s]
    assert len(said) == 1, log[-3000:]
    assert "this node's rank 0 is alive" in said[0], said[0]
    inspect = run_cli("inspect", "--run", "nodes", "--json", f"run.output_dir={tmp_path / 'out'}")
    failed = [json.loads(s) for s in inspect.stdout.splitlines() if "ComponentFailed" in s]
    assert [f["role"] for f in failed] == ["trainer"], inspect.stdout[-3000:]
    assert "a trainer rank on another node is gone" in failed[0]["error"], failed


@pytest.mark.procs
def test_a_rank_whose_rank_0_dies_says_so_in_one_line(tmp_path: Path) -> None:
    node1, up, (trainer_pid,) = _two_nodes(tmp_path)
    try:
        os.kill(int(trainer_pid), signal.SIGKILL)
        out, _ = node1.communicate(timeout=120)
    finally:
        up.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node1.pid, signal.SIGKILL)
        node1.communicate()
    assert node1.returncode == 1, out
    lines = out.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("trainer rank 1: error: "), out
    assert "Traceback" not in out and "[rank1]" not in out, out


def _lone_follower(timeout_s: float, pings: int, every_s: float) -> int:
    """Rank 0 played by this test: a follower rank (``python -m trainer.rank``) gets the
    config, then ``pings`` keepalives ``every_s`` apart, then silence until it gives up
    (``timeout_s``, trainer.dist_timeout_s) or, after the pings, stop when pings > 0; its
    exit code."""
    import time

    from runconfig import config_to_dict
    from trainer.ranks import RankGroup, RankSpec, spawn_ranks, wait_ranks

    port = free_port()
    cfg = load_config(None, ["trainer.n_gpus_per_node=2", "model.d_model=16",
                             "model.n_layers=1", "model.n_heads=2"])
    (proc,) = spawn_ranks(range(1, 2), 2, 2, "127.0.0.1", port, device="cpu",
                          timeout_s=timeout_s)
    group = RankGroup(RankSpec(0, 2, 0, "127.0.0.1", port), torch.device("cpu"), timeout_s)
    try:
        group.open()
        group.send("config", (config_to_dict(cfg), 0))
        from trainer.learner import Learner

        Learner(cfg, group).build()  # the follower builds too: ddp/FSDP wrap has no collective
        for _ in range(pings):
            time.sleep(every_s)
            group.send("ping")
        if pings:
            group.send("stop")
        return wait_ranks([proc], timeout_s * 4 + 60)[0]
    finally:
        proc.kill()
        proc.wait()
        group.close()


@pytest.mark.procs
def test_a_rank_waits_as_long_as_rank_0_says_it_lives_and_gives_up_when_it_stops() -> None:
    # The timeout also bounds the join, which waits for the rank's imports (seconds on a
    # loaded machine): 6 s. Then 6 pings 1.5 s apart: 9 s of idle rank 0, 1.5 timeouts.
    assert _lone_follower(6.0, pings=6, every_s=1.5) == 0
    assert _lone_follower(6.0, pings=0, every_s=0.0) == 1  # silence: it gives up


def test_a_collective_that_lost_a_peer_is_told_from_rank_0_s_own_errors() -> None:
    from runtime.component import Failure
    from trainer.ranks import ChannelBroke, backend_line, collective_failure

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                        "closed by peer [127.0.0.1]:44449. This is typically caused by a remote "
                        "worker crashing. Check the logs of the remote worker. GLHF!\nmore")
    assert collective_failure(gloo) == ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc"
                                        ":553] Connection closed by peer [127.0.0.1]:44449.")
    nccl = torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0")
    assert collective_failure(nccl) == "NCCL communicator was aborted on rank 0"
    broke = ChannelBroke("the trainer ranks' op channel broke: Connection reset by peer")
    assert collective_failure(broke) == str(broke)
    # Rank 0's own faults are its own, even when their words look alike.
    assert collective_failure(RuntimeError("probability tensor contains inf")) is None
    assert collective_failure(Failure("timed out waiting for samples: gloo")) is None
    assert collective_failure(ValueError("connection reset by peer")) is None
    assert backend_line("") == ""


def test_a_rank_seen_exiting_after_rank_0_s_error_is_still_named() -> None:
    # A killed rank resets its sockets before its parent can reap it: rank 0's broken
    # collective comes first. The rank that exits meanwhile is the failure's name.
    from trainer.ranks import LocalRanks, RankFailed

    ranks = LocalRanks(load_config(None, []).trainer)
    broke = RuntimeError("the trainer ranks' op channel broke: Connection reset by peer")
    ranks.procs = [subprocess.Popen(["sleep", "0.5"])]
    failure = asyncio.run(ranks.failure(broke, settle_s=60))
    assert isinstance(failure, RankFailed)
    pid = ranks.procs[0].pid
    assert str(failure).startswith(f"trainer rank 1 (pid {pid}) exited with code 0")
    assert "op channel broke" in str(failure)
    # A rank that stays alive: the error is rank 0's own, after the settle.
    ranks.procs = [subprocess.Popen(["sleep", "60"])]
    try:
        assert asyncio.run(ranks.failure(broke, settle_s=0.2)) is None
    finally:
        ranks.procs[0].kill()
        ranks.procs[0].wait()


@pytest.mark.procs
def test_a_run_resumed_on_more_ranks_measures_its_replay_against_the_publication(
        tmp_path: Path) -> None:
    """A run of 1 rank (a checkpoint every 2 steps) killed after step 5, resumed with 2
    ranks: the resume loads the newest checkpoint and re-applies the steps after it on 2
    ranks, whose sums come in another order, so no hash can match; the model is measured
    against the published weights of its version instead, lands within the tolerance, is
    said so, and the run goes on to its end."""
    out = tmp_path / "out"
    args = [f"run.output_dir={out}", "run.id=grow", *FAST, "trainer.logger=[console]",
            "trainer.save_freq=2", "run.retention=all", "trainer.total_training_steps=8"]
    first = Up([sys.executable, "-m", "rlbus", "up", *args], tmp_path)
    try:
        first.wait_line(lambda s: s.startswith("step ") and int(s.split()[1].split("/")[0]) >= 5)
    finally:
        first.kill()
    more = run_cli("up", *args, "trainer.n_gpus_per_node=2", timeout_s=600)
    assert more.returncode == 0, more.stdout + more.stderr
    events = [json.loads(s) for s in run_cli("inspect", "--run", "grow", "--json",
                                              f"run.output_dir={out}").stdout.splitlines()]
    (resumed,) = [e for e in events if e["type"] == "TrainerResumed"]
    assert resumed["replayed_steps"] >= 1 and resumed["checkpoint_step"] % 2 == 0, resumed
    assert resumed["weights_match"] is False and 0 <= resumed["weights_gap"] <= 0.05, resumed
    said = [e["message"] for e in events if e["type"] == "WarningRaised"
            and e["code"] == "resume_weights_tolerance"]
    assert len(said) == 1 and "changed from 1 to 2" in said[0], said
    finished = sorted({e["step"] for e in events if e["type"] == "StepFinished"})
    assert finished == list(range(1, 9))
