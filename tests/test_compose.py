"""docker-compose.yml cannot be `up`-ed here (no Docker engine), so run every command in it as
a local process, against the redis-server command it names, and check the run completes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bus import free_port
from tests.procs import Procs

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_URL = "redis.url=redis://redis:6379/0"


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_component_service_runs_an_rlbus_command() -> None:
    services = _compose()["services"]
    assert {"redis", "profiler", "trainer", "rollouter0", "rollouter1"} <= set(services)
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["rlbus"]' in dockerfile
    for name, svc in services.items():
        if name == "redis":
            continue
        assert svc["command"][0] in {"trainer", "rollouter", "profiler"}, name
        assert COMPOSE_URL in svc["command"], name


@pytest.mark.e2e
def test_compose_commands_run_as_local_processes(
    tmp_path: Path, redis_binary: str, run_id: str
) -> None:
    services = _compose()["services"]
    port = free_port()
    redis_cmd = [redis_binary if c == "redis-server" else c for c in services["redis"]["command"]]
    data = tmp_path / "redis"
    data.mkdir()
    redis = subprocess.Popen(
        [*redis_cmd, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    procs = Procs(tmp_path / "logs")
    # Shorter than the compose run, same commands: later overrides win.
    short = ["trainer.total_training_steps=3", "global_profiler.steps=[1,3]",
             "trainer.ppo_mini_batch_size=4", "rollout.n=4", "heartbeat.timeout_s=20"]
    try:
        subprocess.run([sys.executable, "-c", "import redis,time\n"
                        f"c=redis.Redis(port={port})\n"
                        "for _ in range(100):\n"
                        "  try:\n    c.ping(); break\n"
                        "  except Exception: time.sleep(0.1)\n"], check=True, timeout=30)
        for name, svc in services.items():
            if name == "redis":
                continue
            argv = [
                f"redis.url={url}" if a == COMPOSE_URL
                else f"run.id={run_id}" if a == "run.id=demo"
                else f"run.output_dir={tmp_path / 'outputs'}" if a.startswith("run.output_dir=")
                else a
                for a in svc["command"]
            ]
            procs.spawn(name, "rlbus", *argv, *short)
        for name in ("trainer", "rollouter0", "rollouter1", "profiler"):
            assert procs.wait(name, 240) == 0, procs.log(name)
        manifest = json.loads(
            (tmp_path / "outputs" / "profiles" / run_id / "manifest.json").read_text()
        )
        done = {(s["role"], s["rank"], s["first_step"]) for s in manifest["sessions"]
                if s["status"] == "ok"}
        assert {("trainer", 0, 1), ("rollouter", 0, 1), ("rollouter", 1, 1),
                ("trainer", 0, 3)} <= done
    finally:
        procs.kill_all()
        redis.terminate()
        redis.wait(timeout=30)
