"""A component's profiler agent: :func:`create_agent` builds the one a trainer or rollouter
holds (None with profiling off), from the run's config, warmed up on the calling thread;
:func:`prepare_main_thread` initialises Kineto on the thread that imported torch first."""

from __future__ import annotations

import torch

from profiling.agent import ProfilerAgent
from profiling.export import BackgroundExporter
from profiling.nsys import nsys_command
from profiling.paths import profile_root, trace_rank, trace_world_size
from runconfig.schema import Config

__all__ = ["create_agent", "prepare_main_thread"]


def create_agent(
    cfg: Config,
    role: str,
    rank: int,
    device: str,
    run_id: str | None = None,
    after_step: int = 0,
) -> ProfilerAgent | None:
    """The agent a component should hold, or ``None`` when profiling is off.

    ``run_id`` overrides ``cfg.run.id``; ``after_step`` is the last finished step when the
    component resumes (see :class:`ProfilerAgent`). The agent takes its tool options
    (``global_tool_config``), its trace rank and the run's world size from ``cfg``, and is
    warmed up (:meth:`ProfilerAgent.warm_up`) before it is returned: call this on the thread
    that will run the steps.
    """
    prof = cfg.global_profiler
    if prof.tool is None:
        return None
    trainers = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    rid = run_id if run_id is not None else cfg.run.id
    agent = ProfilerAgent(
        role,
        rank,
        profile_root(cfg, run_id),
        device,
        after_step=after_step,
        run_id=rid or "",
        world_size=trace_world_size(cfg.rollout.replicas, trace_rank(role, rank, trainers),
                                    trainers=trainers),
        trainers=trainers,
        tools=prof.global_tool_config,
        # Traces are written beside the next step, not before it (profiling.export).
        exporter=BackgroundExporter(),
    )
    if prof.tool == "nsys":
        agent.nsys_command = nsys_command(cfg, role, rank, run_id)
    else:
        agent.warm_up()
    return agent


def prepare_main_thread(cfg: Config, device: str) -> bool:
    """Initialise Kineto (torch.profiler's engine) on the calling thread; True when done.

    Call it from the thread that imported torch (a component's main thread) before the step
    thread creates its agent. Kineto's first initialisation checks that it runs on the thread
    where torch registered its Kineto client (at ``import torch``); the agent's warm-up runs
    on the step thread, so without this every profiled component's log starts with
    ``ERROR: External init callback must run in same thread as registerClient``. A prepare,
    start and stop with nothing recorded: ~20 ms, and the agent's warm-up then finds Kineto
    ready. Nothing when the tool is not torch.profiler's (null, nsys) or on a failure (the
    message is then all that is lost)."""
    if cfg.global_profiler.tool not in ("torch", "torch_memory"):
        return False
    try:
        from torch.autograd import _disable_profiler
        from torch.autograd.profiler import profile

        cuda = device != "cpu" and torch.cuda.is_available()
        prof = profile(use_device="cuda" if cuda else None)
        prof._prepare_trace()
        prof._start_trace()
        _disable_profiler()
    except Exception:
        return False
    return True
