"""``rlbus up run.launcher=ray``: the same components, each placed by Ray as one task.

Ray only schedules: every component still runs as ``python -m PACKAGE`` (a child of its Ray
worker, which dies with it) and talks to the others through Redis, exactly as under the local
launcher. On a cluster, ``run.ray_address`` names the cluster and the trainer asks for a GPU
when ``trainer.device`` is ``cuda``; ``redis.url`` must then be reachable from every node.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import msgspec

from bus import pdeathsig_hook

__all__ = ["RayChild", "init_ray", "ray_children"]


def _run_component(argv: list[str], log_path: str) -> int:
    """Body of the Ray task: run one component to completion; its exit code is the result."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=pdeathsig_hook())
        return proc.wait()


class RayChild(msgspec.Struct):
    """One component as a Ray task; the same interface as the local launcher's Child."""

    name: str
    argv: list[str]
    log_path: Path
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    ref: Any = None
    rc: int | None = None

    def start(self, env: dict[str, str]) -> None:
        import ray

        task = ray.remote(_run_component).options(
            name=self.name, num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_retries=0,
            runtime_env={"env_vars": {"PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1")}},
        )
        self.ref = task.remote(self.argv, str(self.log_path))

    def returncode(self) -> int | None:
        import ray

        if self.rc is None and self.ref is not None:
            ready, _ = ray.wait([self.ref], timeout=0)
            if ready:
                try:
                    self.rc = int(ray.get(ready[0]))
                except Exception:  # the task itself died (worker killed, node lost)
                    self.rc = 1
        return self.rc

    def stop(self, grace_s: float = 15.0) -> None:
        import ray

        if self.ref is not None and self.returncode() is None:
            ray.cancel(self.ref, force=True)
            self.rc = self.rc if self.rc is not None else -15

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(log not on this node)"
        return "\n".join(text.splitlines()[-lines:])


def ray_children(children: list[Any], trainer_gpus: float) -> list[RayChild]:
    """Ray versions of the local launcher's children (same argv and log paths)."""
    out = []
    for c in children:
        gpus = trainer_gpus if c.name == "trainer" else 0.0
        # The profiler service and the logger are I/O only: they should not hold a CPU slot
        # a rollouter needs.
        cpus = 0.1 if c.name in ("profiler", "logger") else 1.0
        out.append(RayChild(c.name, c.argv, c.log_path, num_cpus=cpus, num_gpus=gpus))
    return out


def init_ray(address: str | None, num_cpus: int) -> None:
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)

