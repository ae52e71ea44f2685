"""`rlbus up run.launcher=ray`: the components as Ray tasks (a local Ray started by the run).

Waits are bounded by what they wait for: a local Ray's start by run.ray_connect_timeout_s
(Ray's own node start gives up after a fixed 30 s, which a loaded machine can exceed: the
launcher retries it within that bound), the rollouter's wait for the trainer's first lease by
heartbeat.timeout_s (the trainer imports torch inside a Ray worker first)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.procs import FAST
from tests.waits import wait_until_blocking

pytest.importorskip("ray", reason="the ray extra is not installed")

PATIENT = ("run.ray_connect_timeout_s=600", "heartbeat.timeout_s=600")


def _using(folder: str) -> list[str]:
    """Processes whose command line names ``folder`` (this run's Ray temp dir)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(folder in part for part in p.info["cmdline"] or ()):
            found.append(" ".join(p.info["cmdline"]))
    return found


@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_rlbus_up_on_ray_trains_and_profiles_step_1(tmp_path: Path) -> None:
    # A short temp dir of its own (Ray's socket paths must stay short): its processes are
    # recognisable among those of other Ray users of the machine.
    ray_tmp = tempfile.mkdtemp(prefix="rlray")
    try:
        res = subprocess.run(
            [sys.executable, "-m", "rlbus", "up", "run.launcher=ray", f"run.output_dir={tmp_path}",
             "run.id=ray-e2e", *FAST, *PATIENT, "trainer.total_training_steps=3",
             "global_profiler.tool=torch", "global_profiler.steps=[1]",
             "trainer.n_gpus_per_node=2"],  # two trainer ranks in the trainer's task
            capture_output=True, text=True, timeout=1400,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": ray_tmp},
        )
        assert res.returncode == 0, res.stdout + res.stderr
        assert "Ray launcher" in res.stdout and "step    3/3" in res.stdout
        assert "Traceback" not in res.stderr, res.stderr
        manifest = json.loads((tmp_path / "profiles" / "ray-e2e" / "manifest.json").read_text())
        ok = {(s["role"], s["rank"], s["first_step"]) for s in manifest["sessions"]
              if s["status"] == "ok"}
        assert ok == {("trainer", 0, 1), ("trainer", 1, 1), ("rollouter", 0, 1)}, manifest
        assert re.search(r"^step +3/3 .* 2 ranks$", res.stdout, re.M), res.stdout
        assert _using(ray_tmp) == []  # the local Ray it started is gone with it
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


# --------------------------------------------------------------------------- two nodes

def _ray_cli() -> str:
    return str(Path(sys.executable).parent / "ray")


def _free_port_outside(reserved: range, taken: set[int]) -> int:
    """A free port outside ``reserved`` (the nodes' worker port ranges) and not in ``taken``
    (added to it): Ray refuses a node whose component port falls in a worker range or is
    given to two of its components ("is used by other components"), and two asks for a free
    port may well get the same one (it is free until someone binds it)."""
    from rlbus.redis_binary import free_port

    while (port := free_port()) in reserved or port in taken:
        pass
    taken.add(port)
    return port


def _node_ports(worker_base: int, reserved: range, taken: set[int]) -> list[str]:
    """Ports of one raylet of its own: two Ray nodes share this machine (and other Ray
    users may run beside them); none inside ``reserved``, where the worker ports are, nor
    in ``taken``, the test's ports so far."""
    names = ("node-manager", "object-manager", "dashboard-agent-listen",
             "dashboard-agent-grpc", "runtime-env-agent", "metrics-export")
    return [*(f"--{name}-port={_free_port_outside(reserved, taken)}" for name in names),
            f"--min-worker-port={worker_base}", f"--max-worker-port={worker_base + 40}"]


def _raylet_port(proc: psutil.Process) -> str | None:
    """The node manager port of the raylet ``proc`` descends from (its Ray node), or None."""
    for parent in proc.parents():
        with contextlib.suppress(psutil.Error):
            for part in parent.cmdline():
                if part.startswith("--node_manager_port="):
                    return part.split("=", 1)[1]
    return None


def _placed(run_dir: Path) -> dict[str, str | None]:
    """Component name -> the node manager port of the raylet it runs under."""
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "rlbus" in cmd and any(str(run_dir) in part for part in cmd):
            role = cmd[cmd.index("rlbus") + 1]
            rank = next((a.split("=")[1] for a in cmd if a.startswith("rollout.rank=")), "")
            out[f"{role}{rank}"] = _raylet_port(p)
    return out


def _nodes(gcs: int) -> list[dict[str, Any]]:
    """The cluster's nodes (``ray list nodes``-like, through a short driver)."""
    code = (f"import json, ray; ray.init(address='127.0.0.1:{gcs}', log_to_driver=False); "
            "print(json.dumps([{'NodeID': n['NodeID'], 'port': str(n['NodeManagerPort'])} "
            "for n in ray.nodes()]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


RAY_START_TRIES = 3


def _ray_start(args: list[str], env: dict[str, str]) -> None:
    """``ray start ARGS``. Ray's node waits a fixed 30 s for its own processes, which a loaded
    machine can exceed ("timed out during startup"): that start is undone and tried again,
    as rlbus's own local start does (rlbus.ray_launcher)."""
    for attempt in range(1, RAY_START_TRIES + 1):
        res = subprocess.run([_ray_cli(), "start", *args], env=env, capture_output=True,
                             text=True, timeout=600)
        if res.returncode == 0:
            return
        if "timed out during startup" not in res.stderr or attempt == RAY_START_TRIES:
            break
        _undo_start(args)
    raise AssertionError(f"ray start {' '.join(args)}:\n{res.stdout}\n{res.stderr}")


def _undo_start(args: list[str]) -> None:
    """Kill what a failed ``ray start ARGS`` left running: the processes naming its temp dir
    or one of its (free, this test's own) ports, never another Ray user's."""
    marks = [value for a in args if a.startswith("--") and "=" in a
             and (a.startswith("--temp-dir=") or a.split("=", 1)[0].endswith("port"))
             for value in [a.split("=", 1)[1]]]
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or ())
        if any(m in line if m.startswith("/") else re.search(rf"[=:]{m}\b", line)
               for m in marks):
            with contextlib.suppress(psutil.Error):
                p.kill()


def _remove_cluster(ray_tmp: str, gcs: int) -> None:
    """Kill this test's Ray processes (its temp dir or its GCS port in their command line,
    never another Ray user's) and remove its temp dir."""
    for p in psutil.process_iter(["cmdline"]):
        if any(ray_tmp in part or f"127.0.0.1:{gcs}" in part
               for part in p.info["cmdline"] or ()):
            with contextlib.suppress(psutil.Error):
                p.kill()
    shutil.rmtree(ray_tmp, ignore_errors=True)


def _port_of(args: list[str]) -> str:
    return next(a.split("=")[1] for a in args if a.startswith("--node-manager-port="))


@pytest.mark.e2e
@pytest.mark.asyncio
@pytest.mark.timeout(1500)
async def test_two_nodes_placed_as_asked_and_a_lost_node_named_and_survived(
    redis_url: str, bus: Any, run_id: str, run_keys: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head (the trainer's node: resource `trainer`) and a worker raylet on this machine,
    with token auth (Ray 2.60 clusters use it). The trainer lands on the head, the two
    rollouters spread one per node; killing the worker's raylet loses its rollouter, which is
    named in the run's log with the dead node and restarted on the head; the run goes on
    (then it is stopped) with every step once and no sample twice."""
    from runschema.messages import StepFinished, WarningRaised
    from tests.procs import assert_every_step_once, events_of
    from tests.test_supervise import Up

    ray_tmp = tempfile.mkdtemp(prefix="rl2n")
    # Every Ray process of the test and rlbus up's driver: the same token.
    for name, value in {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex(),
                        "RAY_TMPDIR": ray_tmp}.items():
        monkeypatch.setenv(name, value)
    env = dict(os.environ)
    base = 30000 + (os.getpid() % 200) * 100
    reserved = range(base, base + 91)  # both nodes' worker ports
    taken: set[int] = set()  # every port this test gives out, each once
    gcs = _free_port_outside(reserved, taken)
    head = _node_ports(base, reserved, taken)
    worker = _node_ports(base + 50, reserved, taken)
    common = ["--disable-usage-stats", "--num-gpus=0", "--node-ip-address=127.0.0.1"]
    try:
        _ray_start(["--head", f"--port={gcs}", f"--temp-dir={ray_tmp}", "--num-cpus=3",
                    '--resources={"trainer": 1}', "--include-dashboard=false",
                    f"--ray-client-server-port={_free_port_outside(reserved, taken)}",
                    *common, *head],
                   env)
        _ray_start([f"--address=127.0.0.1:{gcs}", "--num-cpus=1", *common, *worker], env)
        # Before the run: a driver of its own takes seconds to connect.
        worker_id = next(n["NodeID"] for n in _nodes(gcs) if n["port"] == _port_of(worker))
        # A run longer than this test: Ray reports the lost task when it declares the node
        # dead (seconds to tens of seconds); the run goes on meanwhile and after.
        steps = 100_000
        up = Up([sys.executable, "-m", "rlbus", "up", "run.launcher=ray",
                 f"run.ray_address=127.0.0.1:{gcs}", f"redis.url={redis_url}", f"run.id={run_id}",
                 # Relative, as a user types it: Ray's workers run where `ray start` ran
                 # (not tmp_path): rlbus up makes it absolute before submitting.
                 "run.output_dir=out", *FAST, *PATIENT, "heartbeat.timeout_s=10",
                 "trainer.logger=[console]", "rollout.replicas=2",
                 "run.ray.trainer_resources={trainer: 1}",
                 f"trainer.total_training_steps={steps}"], tmp_path)
        try:
            up.wait_line(lambda s: s.startswith("step ") and int(s.split()[1].split("/")[0]) >= 2)
            where = _placed(tmp_path / "out" / run_id)
            assert set(where) == {"trainer", "rollouter0", "rollouter1"}, where
            head_port, worker_port = _port_of(head), _port_of(worker)
            assert where.get("trainer") == head_port, where
            assert sorted([where.get("rollouter0"), where.get("rollouter1")]) == sorted(
                [head_port, worker_port]), where
            lost = next(n for n in ("rollouter0", "rollouter1") if where[n] == worker_port)
            raylet = next(p for p in psutil.process_iter(["cmdline"])
                          if f"--node_manager_port={worker_port}" in (p.info["cmdline"] or []))
            raylet.kill()
            up.wait_line(lambda s: s.startswith("warning from rlbus up: "))
            after = int(up.wait_line(lambda s: s.startswith("step ")).split()[1].split("/")[0])
            # The run goes on: three more steps after the restart, then stop it.
            up.wait_line(lambda s: s.startswith("step ")
                         and int(s.split()[1].split("/")[0]) >= after + 3)
            up.proc.send_signal(signal.SIGTERM)
            rc, out = up.finish()
        finally:
            up.kill()
        assert rc == 128 + signal.SIGTERM, out
        warned = [s for s in out.splitlines() if s.startswith("warning from rlbus up: ")]
        assert len(warned) == 1 and warned[0].split()[4] == f"{lost}", out
        assert "restarted (1 of 3" in warned[0] and "NodeDiedError" in warned[0], out
        assert "[state-dump]" not in out, out  # Ray's errors: one line each
        events = await events_of(bus, run_keys.events)
        done = max(e.step for e in events if isinstance(e, StepFinished))
        assert done >= after + 3
        assert_every_step_once(events, done)
        logged = [e for e in events if isinstance(e, WarningRaised) and e.source == "rlbus up"]
        assert [e.code for e in logged] == ["component_restarted"], logged
        assert logged[0].message.startswith(f"{lost} lost: "), logged[0].message
        assert worker_id in logged[0].message, logged[0].message  # the dead node, named
    finally:
        _remove_cluster(ray_tmp, gcs)


# --------------------------------------------------------------------------- placement wait

@pytest.mark.procs
@pytest.mark.timeout(600)
def test_a_task_no_node_has_room_for_is_named_then_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A local Ray whose one node offers {slot: 1}; two rollouters each ask for {slot: 1}.
    The first is placed and runs; the second waits unplaced (Ray holds it pending): RunWatch
    says so once (component_unplaced, naming the slot), then past run.ray.placement_timeout_s
    names it component_failed and stops the run. Stopping cancels the pending task.

    The second is submitted once the first holds the slot (Ray could place either first), and
    its wait is set by its submission time, not slept: a loaded machine that takes longer to
    place the first (a Ray worker starting) then skips no verdict."""
    from rlbus.children import Console
    from rlbus.ray_launcher import RayChild, init_ray, shutdown_ray
    from rlbus.supervise import Supervisor
    from rlbus.watching import PLACEMENT_WARN_S, Progress, RestartPolicy, RunWatch, Summary

    ray_tmp = tempfile.mkdtemp(prefix="rlpl")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    asks = {"num_cpus": 0, "num_gpus": 0, "resources": {"slot": 1.0}}
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    children = [RayChild(f"rollouter{i}", sleeper, tmp_path / f"rollouter{i}.log", dict(asks))
                for i in range(2)]
    bound_s = 600.0  # the warning comes at PLACEMENT_WARN_S, far from the bound
    try:
        init_ray(None, 2, timeout_s=300, resources={"slot": 1.0})
        first, second = children
        first.start({})
        wait_until_blocking(lambda: first.placed or None, "rollouter0 to be placed", 180)
        submitted = time.monotonic()
        second.start({})
        assert submitted <= second.submitted_at <= time.monotonic()  # its wait counts from here
        sup = Supervisor()
        watch = RunWatch("r", children, sup, Progress(10, 0, Console(sup)), Summary(), set(),
                         policy=RestartPolicy(3), placement_timeout_s=bound_s)
        # Waited as long as makes RunWatch say so (once), and no longer than the bound.
        second.submitted_at = time.monotonic() - PLACEMENT_WARN_S
        assert watch._verdict() is None and watch._verdict() is None
        assert not second.placed and second.returncode() is None
        assert len(watch.pending) == 1, watch.pending
        code, text = watch.pending[0]
        assert code == "component_unplaced" and text.startswith("rollouter1 not placed by Ray")
        assert "resources={'slot': 1.0}" in text, text
        # Waited the bound, still unplaced: the run stops.
        second.submitted_at = time.monotonic() - bound_s
        assert watch._verdict() == 1
        assert [c for c, _ in watch.pending] == ["component_unplaced", "component_failed"]
        assert watch.pending[1][1].startswith("rollouter1 not placed by Ray after ")
        assert first.placed and first.returncode() is None  # the placed one runs on
        for child in children:
            child.stop()
        assert second.returncode() is not None and first.returncode() is not None
    finally:
        for child in children:
            with contextlib.suppress(Exception):
                child.stop()
        shutdown_ray()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_trainer_nodes_are_tasks_of_their_own_asking_for_their_ranks() -> None:
    """trainer.nnodes=3 on Ray: trainer-node1 and trainer-node2 run `rlbus trainer` with
    their node_rank; each trainer task asks for one CPU per rank (and a GPU each on CUDA)."""
    from rlbus.children import Child
    from rlbus.ray_launcher import ray_options, trainer_nodes
    from runconfig import load_config
    from runconfig.schema import RayPlacementConfig

    tc = load_config(None, ["trainer.nnodes=3", "trainer.n_gpus_per_node=2",
                            "trainer.master_port=29500"]).trainer
    logs = Path("/logs")
    children = [Child("rollouter0", ["rollouter"], logs / "rollouter0.log"),
                Child("trainer", ["python", "-m", "rlbus", "trainer"], logs / "trainer.log")]
    out = trainer_nodes(children, tc)
    assert [c.name for c in out] == ["rollouter0", "trainer", "trainer-node1", "trainer-node2"]
    assert out[2].argv == ["python", "-m", "rlbus", "trainer", "trainer.node_rank=1"]
    assert out[3].log_path == logs / "trainer-node2.log"
    opts = ray_options("trainer-node1", RayPlacementConfig(), trainer_gpus=2.0, trainer_cpus=2)
    assert (opts["num_cpus"], opts["num_gpus"]) == (2, 2.0)


@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_trainer_ranks_on_two_ray_nodes_meet_on_the_first(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.nnodes=2 on a two-node Ray cluster (two raylets on this machine): rank 0's
    task and trainer-node1's land on different nodes (STRICT_SPREAD), rank 1 meets rank 0
    at bundle 0's node, and the run trains with 2 ranks."""
    ray_tmp = tempfile.mkdtemp(prefix="rl2t")
    for name, value in {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex(),
                        "RAY_TMPDIR": ray_tmp}.items():
        monkeypatch.setenv(name, value)
    env = dict(os.environ)
    base = 30000 + ((os.getpid() + 97) % 200) * 100
    reserved = range(base, base + 91)
    taken: set[int] = set()  # every port this test gives out, each once
    gcs = _free_port_outside(reserved, taken)
    head = _node_ports(base, reserved, taken)
    worker = _node_ports(base + 50, reserved, taken)
    common = ["--disable-usage-stats", "--num-gpus=0", "--node-ip-address=127.0.0.1"]
    try:
        _ray_start(["--head", f"--port={gcs}", f"--temp-dir={ray_tmp}", "--num-cpus=3",
                    "--include-dashboard=false",
                    f"--ray-client-server-port={_free_port_outside(reserved, taken)}",
                    *common, *head],
                   env)
        _ray_start([f"--address=127.0.0.1:{gcs}", "--num-cpus=2", *common, *worker], env)
        res = subprocess.run(
            [sys.executable, "-m", "rlbus", "up", "run.launcher=ray",
             f"run.ray_address=127.0.0.1:{gcs}", "run.output_dir=out", "run.id=two-nodes",
             *FAST, *PATIENT, "trainer.logger=[console]", "trainer.total_training_steps=3",
             "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
             f"trainer.master_port={_free_port_outside(reserved, taken)}"],
            capture_output=True, text=True, timeout=1400, cwd=tmp_path, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        addr = re.search(r"Ray launcher: 2 trainer nodes, rank 0 at (\S+):\d+$", res.stdout, re.M)
        assert addr, res.stdout  # bundle 0's node, as Ray names it
        assert re.search(r"^step +3/3 .* 2 ranks$", res.stdout, re.M), res.stdout
        logs = tmp_path / "out" / "two-nodes" / "logs"
        node1 = (logs / "trainer-node1.log").read_text()
        assert f"node 1: ranks 1..1 joining {addr.group(1)}:" in node1, node1
    finally:
        _remove_cluster(ray_tmp, gcs)
