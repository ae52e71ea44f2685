"""The generated ACL follows the code: every role's real code, each as its own process under
its own ACL user (deploy/redis/users.acl, rendered by start-redis.sh as docker-compose.yml
does), through a live profile request, validation, checkpoints with retention, a trainer
killed and resumed, and each weights transport. Redis records every command it refuses in
its ACL LOG: a NOPERM anywhere, in any process, whether or not that process survived it,
fails the test (with the log's entries: user, command or key, context)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import redis

from bus import Bus, RunKeys
from runschema.messages import (
    Message,
    ProfileStarted,
    StepFinished,
    TrainerResumed,
    ValidationFinished,
)
from runtime.history import find_archive
from tests.compose_redis import AclRedis, password
from tests.procs import FAST, Procs, events_of, run_cli
from tests.waits import event, wait_for

pytest.importorskip("tasks.verl_data", reason="the verl data loader is not in this tree")

STEPS = 8


def _url(server: AclRedis, user: str) -> str:
    return f"redis.url={server.url(user)}"


def _acl_log(server: AclRedis) -> list[dict[str, object]]:
    admin = redis.Redis(port=server.port, username="admin", password=password("admin"),
                        socket_timeout=10)
    try:
        return admin.acl_log(count=128)
    finally:
        admin.close()


async def _log_of(server: AclRedis, run_id: str) -> list[Message]:
    """The run's whole log (archive, then every role's stream), as an operator reads it."""
    bus = Bus.from_url(server.url("admin"))
    try:
        return await events_of(bus, RunKeys(run_id).events)
    finally:
        await bus.close()


async def _wait_step(server: AclRedis, run_id: str, step: int, procs: Procs) -> None:
    bus = Bus.from_url(server.url("admin"))
    try:
        await wait_for(bus, RunKeys(run_id).events, event(StepFinished, step=step), 240,
                       procs.watch("trainer"))
    finally:
        await bus.close()


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["redis", "storage", "collective"])
def test_every_role_runs_its_real_code_under_its_acl_user(
    tmp_path: Path, redis7_binary: str, run_id: str, transport: str
) -> None:
    from tasks.chatdemo import build_demo

    demo = build_demo(tmp_path / "demo", n_train=64, n_val=8)
    server = AclRedis(redis7_binary, tmp_path / "redis", run_id)
    procs = Procs(tmp_path / "logs")
    out = tmp_path / "outputs"
    common = [f"run.id={run_id}", f"run.output_dir={out}", *FAST,
              "model.kind=hf", f"model.path={demo / 'model'}",
              f"data.train_files={demo / 'train.parquet'}",
              f"data.val_files={demo / 'val.parquet'}",
              f"custom_reward_function.path={demo / 'reward.py'}",
              "rollout.max_new_tokens=8", f"trainer.total_training_steps={STEPS}",
              "trainer.test_freq=4", "trainer.save_freq=2", "run.retention=checkpoint",
              "global_profiler.tool=torch", "global_profiler.steps=[1]",
              f"rollout.weights_transport={transport}",
              "async_training.staleness_threshold=0", "heartbeat.timeout_s=60"]
    try:
        procs.spawn("profiler", "rlbus", "profiler", _url(server, "profiler"), *common)
        procs.spawn("logger", "rlbus", "logger", _url(server, "logger"), *common,
                    "trainer.logger=[console,tensorboard]")
        procs.spawn("rollouter0", "rlbus", "rollouter", _url(server, "rollouter"), *common)
        procs.spawn("trainer", "rlbus", "trainer", _url(server, "trainer"), *common)
        # On-policy, the trainer cannot finish a step past the rollouter's: with the
        # rollouter paused after step 2 the run waits (nothing here races its speed) while an
        # operator asks for a live profile, which the profiler service answers, and the
        # trainer dies after its step-2 checkpoint; a new one resumes the run.
        asyncio.run(_wait_step(server, run_id, 2, procs))
        os.killpg(procs.procs["rollouter0"].pid, signal.SIGSTOP)
        res = run_cli("profile", "--run", run_id, "--steps", "next:1",
                      _url(server, "operator"), f"run.output_dir={out}")
        assert res.returncode == 0, res.stdout + res.stderr + procs.log("profiler")
        os.killpg(procs.procs["trainer"].pid, signal.SIGKILL)
        procs.procs["trainer"].wait(30)
        os.killpg(procs.procs["rollouter0"].pid, signal.SIGCONT)
        procs.spawn("trainer2", "rlbus", "trainer", _url(server, "trainer"), *common)
        for name in ("trainer2", "rollouter0", "profiler", "logger"):
            assert procs.wait(name, 300) == 0, procs.log(name)
        res = run_cli("inspect", "--run", run_id, "--json", _url(server, "operator"),
                      f"run.output_dir={out}")
        assert res.returncode == 0, res.stdout + res.stderr

        denied = _acl_log(server)
        assert denied == [], "Redis refused commands:\n" + "\n".join(
            f"{d.get('username')}: {d.get('reason')} {d.get('object')} ({d.get('context')})"
            for d in denied)
        # Each path really ran: a checkpoint let retention archive the log's beginning, the
        # trainer resumed, validation answered, the live request profiled its steps.
        events = asyncio.run(_log_of(server, run_id))
        assert any(isinstance(e, TrainerResumed) for e in events)
        answers = [e for e in events if isinstance(e, ValidationFinished)]
        assert answers and not any(a.error for a in answers), answers
        assert {e.step for e in events if isinstance(e, StepFinished)} == set(
            range(1, STEPS + 1))
        manifest = json.loads((out / "profiles" / run_id / "manifest.json").read_text())
        live = [s for s in manifest["sessions"] if s["first_step"] > 1 and s["status"] == "ok"]
        assert live, manifest
        assert any(isinstance(e, ProfileStarted) and e.step > 1 for e in events)
        assert asyncio.run(_archived(server, run_id)), "retention archived nothing"
    finally:
        procs.kill_all()
        server.stop()


async def _archived(server: AclRedis, run_id: str) -> bool:
    bus = Bus.from_url(server.url("admin"))
    try:
        return await find_archive(bus, RunKeys(run_id), None) is not None
    finally:
        await bus.close()
