"""``rlbus up run.launcher=ray``: the same components, each placed by Ray as one task.

Ray only schedules: every component still runs as ``python -m PACKAGE`` (a child of its Ray
worker, which dies with it) and talks to the others through Redis, exactly as under the local
launcher. On a cluster, ``run.ray_address`` names the cluster and the trainer asks for a GPU
when ``trainer.device`` is ``cuda``; ``redis.url`` must then be reachable from every node.

Waiting for Ray is bounded by ``run.ray_connect_timeout_s``: :func:`probe_address` checks that
``run.ray_address`` accepts a TCP connection and answers as a gRPC server before ``ray.init``
is called (``ray.init`` on an address where nothing listens retries for many minutes, and on
one where another server listens, e.g. Redis on Ray's default port, for ever), and
:func:`init_ray` turns any
failure to connect or to start a local Ray into one :class:`RayUnavailable` naming it.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import psutil

from rlbus.redis_server import pdeathsig_hook
from runconfig import ConfigError
from runconfig.schema import RayPlacementConfig, TrainerConfig

__all__ = [
    "RayChild",
    "RayUnavailable",
    "init_ray",
    "local_resources",
    "missing_resources",
    "place_trainer_nodes",
    "probe_address",
    "ray_children",
    "ray_endpoint",
    "ray_options",
    "shutdown_ray",
    "trainer_nodes",
]

_PROBE_EVERY_S = 0.5
"""Pause between two connection attempts to ``run.ray_address``."""


class RayUnavailable(Exception):
    """Ray could not be reached (``run.ray_address``) or started (a local Ray) in time."""


def _run_component(argv: list[str], log_path: str) -> Iterator[str | int]:
    """Body of the Ray task: first its node's id (the driver learns that Ray placed and
    started it: :attr:`RayChild.placed`), then the component's exit code, run to completion."""
    import ray

    yield ray.get_runtime_context().get_node_id()
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=pdeathsig_hook())
        yield proc.wait()


class RayChild(msgspec.Struct):
    """One component as a Ray task; the same interface as the local launcher's Child."""

    name: str
    argv: list[str]
    log_path: Path
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Its task's Ray options (:func:`ray_options`)."""
    ref: Any = None
    """The task's generator of results (its node's id, then the exit code)."""
    rc: int | None = None
    lost: str = ""
    """Why its task ended without an exit code (node or worker lost), named by Ray."""
    node: str = ""
    """The id of the Ray node it runs on, once Ray placed and started it."""
    submitted_at: float = 0.0
    """``time.monotonic()`` of its latest submission (the wait to be placed counts from it)."""

    @property
    def started(self) -> bool:
        """Whether its task was submitted (a child never started has nothing to stop)."""
        return self.ref is not None

    @property
    def placed(self) -> bool:
        """Whether Ray started its task on a node (a submitted task may wait for room)."""
        self.returncode()
        return bool(self.node)

    def asks(self) -> str:
        """What its task asks Ray for (``num_cpus=1, num_gpus=0, resources={...}``)."""
        return ", ".join(f"{k}={v}" for k, v in self.options.items()
                         if k != "scheduling_strategy")

    def start(self, env: dict[str, str]) -> None:
        import ray

        task = ray.remote(_run_component).options(
            name=self.name, max_retries=0, **self.options,
            runtime_env={"env_vars": {"PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1")}},
        )
        self.rc, self.lost, self.node = None, "", ""
        self.submitted_at = time.monotonic()
        self.ref = task.remote(self.argv, str(self.log_path))

    def returncode(self) -> int | None:
        import ray

        # Each result the task yielded so far: its node's id, then its exit code.
        while self.rc is None and self.ref is not None and ray.wait([self.ref], timeout=0)[0]:
            try:
                item = ray.get(next(self.ref))
            except StopIteration:  # ended without an exit code (cannot happen but by Ray)
                self.rc, self.lost = 1, "its Ray task ended without an exit code"
            except Exception as exc:  # the task itself died (worker killed, node lost)
                self.rc = 1
                self.lost = lost_reason(exc) + dead_nodes()
            else:
                if self.node:
                    self.rc = int(item)
                else:
                    self.node = str(item)
        return self.rc

    def stop(self, grace_s: float = 15.0) -> None:
        if self.ref is None or self.returncode() is not None:
            return
        import ray

        ray.cancel(self.ref, force=True)
        self.rc = -15

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(log not on this node)"
        return "\n".join(text.splitlines()[-lines:])


def lost_reason(exc: BaseException) -> str:
    """One line naming what Ray says was lost (its first line names the node or worker),
    instead of the many lines of cluster state Ray appends."""
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {first}"[:300]


def dead_nodes() -> str:
    """``; dead Ray node(s): IP (node id)`` for every node the cluster lists as dead (a lost
    task is most often the node's), or nothing."""
    import ray

    try:
        dead = [f"{n.get('NodeManagerAddress', '?')} ({str(n.get('NodeID', '?'))[:12]})"
                for n in ray.nodes() if not n.get("Alive", True)]
    except Exception:  # the cluster itself is gone: the task's own reason says so
        return ""
    return f"; dead Ray node(s): {', '.join(dead)}" if dead else ""


def ray_options(name: str, placement: RayPlacementConfig, trainer_gpus: float,
                trainer_cpus: int = 1) -> dict[str, Any]:
    """The Ray task options of the component ``name`` (trainer, rollouterN, profiler,
    logger): its CPUs, GPUs, custom resources and scheduling strategy. Pure.

    The profiler service and the logger only read the log and write files: they ask for no
    CPU, so a 1-CPU node still runs its trainer or rollouter (a 0.1 CPU logger once took
    the only slot the trainer needed). The trainer asks for ``run.ray.trainer_resources``
    (a node label as a custom resource: it lands there), the rollouters for
    ``run.ray.rollouter_resources``, spread over the nodes by ``run.ray.rollouter_strategy``.
    The trainer's task holds its node's ranks (``trainer_cpus`` CPUs, ``trainer_gpus``
    GPUs); with several nodes each node's task (``trainer-nodeK``) is one bundle of the
    trainer's placement group (:func:`trainer_nodes`)."""
    if name in ("profiler", "logger"):
        return {"num_cpus": 0, "num_gpus": 0}
    if name == "trainer" or name.startswith("trainer-node"):
        return {"num_cpus": trainer_cpus, "num_gpus": trainer_gpus,
                "resources": dict(placement.trainer_resources)}
    return {"num_cpus": 1, "num_gpus": 0, "resources": dict(placement.rollouter_resources),
            "scheduling_strategy": placement.rollouter_strategy}


def local_resources(placement: RayPlacementConfig, replicas: int) -> dict[str, float]:
    """The custom resources a local Ray (no ``run.ray_address``) is started with: what the
    placement asks for, so one machine holds every role (else a trainer asking for
    ``{trainer: 1}`` would wait forever for a node that has it). Pure."""
    out = dict(placement.trainer_resources)
    for name, amount in placement.rollouter_resources.items():
        out[name] = out.get(name, 0.0) + amount * replicas
    return out


def missing_resources(placement: RayPlacementConfig, cluster: dict[str, float]) -> list[str]:
    """``KEY: NAME`` for each custom resource the placement asks for that no node of the
    cluster offers (``cluster``: ``ray.cluster_resources()``); empty when all are there."""
    asked = [("run.ray.trainer_resources", placement.trainer_resources),
             ("run.ray.rollouter_resources", placement.rollouter_resources)]
    return [f"{key}: {name}" for key, wanted in asked for name, amount in wanted.items()
            if cluster.get(name, 0.0) < amount]


def ray_children(children: list[Any], placement: RayPlacementConfig,
                 trainer_gpus: float, trainer_cpus: int = 1) -> list[RayChild]:
    """Ray versions of the local launcher's children (same argv and log paths)."""
    return [RayChild(c.name, c.argv, c.log_path,
                     ray_options(c.name, placement, trainer_gpus, trainer_cpus))
            for c in children]


def trainer_nodes(children: list[Any], tc: TrainerConfig) -> list[Any]:
    """With ``trainer.nnodes`` > 1, a ``trainer-nodeK`` child for each node but rank 0's
    (``rlbus trainer trainer.node_rank=K``, the trainer's argv otherwise), after the trainer.
    Pure: the meeting address is set by :func:`place_trainer_nodes`."""
    trainer = next(c for c in children if c.name == "trainer")
    nodes = [msgspec.structs.replace(trainer, name=f"trainer-node{k}",
                                     argv=[*trainer.argv, f"trainer.node_rank={k}"],
                                     log_path=trainer.log_path.with_name(f"trainer-node{k}.log"))
             for k in range(1, tc.nnodes)]
    return [*children, *nodes]


def place_trainer_nodes(placed: list[RayChild], tc: TrainerConfig, cpus: int, gpus: float,
                        timeout_s: float) -> str:
    """Reserve one bundle per trainer node (a placement group, ``STRICT_SPREAD``: one node
    each), pin the trainer to bundle 0 and ``trainer-nodeK`` to bundle K, and point every
    rank at bundle 0's node (``trainer.master_addr``); that address. Waits up to
    ``timeout_s`` for the cluster to hold the group (RayUnavailable naming it)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle: dict[str, float] = {"CPU": float(cpus), **({"GPU": gpus} if gpus else {})}
    pg = placement_group([dict(bundle) for _ in range(tc.nnodes)], strategy="STRICT_SPREAD",
                         name="rlbus-trainer")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise RayUnavailable(
            f"no {tc.nnodes} Ray nodes with {bundle} each for the trainer's ranks within "
            f"{timeout_s:g} s (trainer.nnodes, trainer.n_gpus_per_node; "
            "run.ray.placement_timeout_s)")
    table = ray.util.placement_group_table(pg)
    node_of = table["bundles_to_node_id"]
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    addr = str(ips[node_of[0]])
    for child in placed:
        if child.name == "trainer" or child.name.startswith("trainer-node"):
            index = 0 if child.name == "trainer" else int(child.name.removeprefix("trainer-node"))
            child.options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index)
            child.options.pop("resources", None)  # the bundle holds what it needs
            child.argv = [*child.argv, f"trainer.master_addr={addr}"]
    return addr


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """Where ``address`` listens: ``HOST:PORT`` or ``SCHEME://HOST:PORT``; None for Ray's
    ``auto`` and ``local``, which name no socket. A malformed one is a config error."""
    if address in ("auto", "local"):
        return None
    parts = urlsplit(address if "://" in address else f"ray-gcs://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ConfigError("run.ray_address", f"{address!r} is not HOST:PORT, ray://HOST:PORT, "
                                             "auto or local")
    return parts.hostname, port


def probe_address(address: str, timeout_s: float,
                  cancelled: Callable[[], bool] = lambda: False) -> None:
    """Return once ``address`` accepts a TCP connection and answers as Ray does (gRPC:
    :func:`speaks_grpc`); raise :class:`RayUnavailable` naming it when it has not within
    ``timeout_s`` seconds, or at once when it answers as something else (Ray's default port
    is Redis's: ``ray.init`` on a Redis server waits for ever). Returns early when
    ``cancelled()`` (a signal arrived: the caller stops). ``auto``/``local`` are left to
    ``ray.init``."""
    where = ray_endpoint(address)
    if where is None:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection(where, timeout=max(0.1, min(2.0, left))) as conn:
                _check_grpc(conn, address, max(0.5, deadline - time.monotonic()))
                return
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        if cancelled():
            return
        if time.monotonic() >= deadline:
            raise RayUnavailable(f"no Ray cluster answers at run.ray_address={address} "
                                 f"({why}; waited {timeout_s:g} s, run.ray_connect_timeout_s)")
        time.sleep(min(_PROBE_EVERY_S, max(0.0, deadline - time.monotonic())))


# HTTP/2's client connection preface (RFC 9113, 3.4): a gRPC server (Ray's GCS and its
# client server are gRPC) answers it with a SETTINGS frame, whose 9-byte header has type 4.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4


def speaks_grpc(reply: bytes) -> bool:
    """Whether ``reply``, the first bytes a server sent after HTTP/2's preface, is a frame
    header of a SETTINGS frame (what every HTTP/2 server sends first)."""
    return len(reply) >= 9 and reply[3] == _H2_SETTINGS


def _check_grpc(conn: socket.socket, address: str, timeout_s: float) -> None:
    """Send HTTP/2's preface on ``conn``; a reply that is not HTTP/2 is
    :class:`RayUnavailable` naming what answered. A server that stays silent within
    ``timeout_s`` is one that does not speak first either: refused the same way."""
    conn.settimeout(timeout_s)
    conn.sendall(_H2_PREFACE)
    reply = b""
    try:
        while len(reply) < 9:
            chunk = conn.recv(80 - len(reply))  # a frame header, or a line that says what it is
            if not chunk:
                break
            reply += chunk
    except (TimeoutError, ConnectionError):
        pass  # judged by what came before
    if speaks_grpc(reply):
        return
    said = reply.decode("ascii", "replace").splitlines()[0].strip() if reply else "nothing"
    hint = " (a Redis server? Ray's default port 6379 is Redis's)" if reply[:1] in (
        b"-", b"+") else ""
    raise RayUnavailable(f"run.ray_address={address} answers but is not a Ray cluster: "
                         f"it replied {said[:60]!r} to a gRPC client{hint}")


def init_ray(address: str | None, num_cpus: int, timeout_s: float = 60.0,
             cancelled: Callable[[], bool] = lambda: False,
             resources: dict[str, float] | None = None) -> None:
    """Connect to ``address`` (probed first: see :func:`probe_address`) or start a local Ray.

    A local start that Ray itself gives up on (its node waits a fixed 30 s for the raylet,
    which a loaded machine can exceed) is retried while ``timeout_s`` lasts. Every failure is
    one :class:`RayUnavailable` naming the address or the local start."""
    import ray

    if ray.is_initialized():
        return
    if address:
        probe_address(address, timeout_s, cancelled)
        if cancelled():
            return
        try:
            ray.init(address=address, log_to_driver=False)
        except Exception as exc:  # whatever ray.init raises: one line naming the address
            raise RayUnavailable(f"cannot connect to Ray at run.ray_address={address}: "
                                 f"{type(exc).__name__}: {exc}") from None
        _one_line_ray_errors()
        return
    _start_local(num_cpus, timeout_s, cancelled, resources or {})


def _one_line_ray_errors() -> None:
    """Ray's driver prints each cluster error (a raylet that died: 40 lines of its log and
    state) on the console; keep the first line of each. The loss itself is named by
    ``rlbus up`` (the component, the dead node) in the run's log. Ray's printer is private:
    left alone where it is not found."""
    try:
        from ray._private import worker
    except ImportError:
        return
    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "rlbus_one_line", False):
        return

    def one_line(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet":
            lines = [ln for m in data.get("lines", []) for ln in str(m).splitlines()[:1]]
            data = {**data, "lines": [ln[:300] for ln in lines]}
        printer(data, ignore_prefix)

    # A mark on the function itself (checked above): Ray's printer is wrapped once, however
    # often this runs; mypy knows no attributes of a function.
    one_line.rlbus_one_line = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = one_line


def _start_local(num_cpus: int, timeout_s: float, cancelled: Callable[[], bool],
                 resources: dict[str, float]) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     resources=resources)
            _one_line_ray_errors()
            return
        except Exception as exc:  # e.g. "The current node timed out during startup"
            shutdown_ray()
            # A node that failed in its constructor is unknown to ray.shutdown: its GCS and
            # raylet are our children started by this attempt.
            _kill_new_children(before)
            if cancelled() or time.monotonic() >= deadline:
                raise RayUnavailable(
                    f"cannot start a local Ray within {timeout_s:g} s "
                    f"(run.ray_connect_timeout_s): {type(exc).__name__}: {exc}") from None


def _kill_new_children(before: set[int]) -> None:
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for proc in new:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(new, timeout=5)


def shutdown_ray() -> None:
    """Disconnect from Ray, stopping a local Ray this process started (nothing left running)."""
    import ray

    # ray.shutdown() is a no-op when nothing was started; a half-started Ray may raise.
    with contextlib.suppress(Exception):
        ray.shutdown()
