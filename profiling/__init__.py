"""Profiling shared by the trainer and the rollouter: the in-process profiler agent.

Components import this package, never each other. With profiling off they create no agent
(:func:`create_agent` returns ``None``). The agent does no bus I/O: the component feeds it the
control commands it read and publishes the events it returns.

The agent (and torch) is imported on first use, so the torch-free helpers (paths, the finish
hook's environment, the nsys command line, trace finishing) cost a process such as the
profiler service no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from profiling.hook import hook_env
from profiling.nsys import nsys_command
from profiling.paths import (
    profile_root,
    safe_name,
    session_view_path,
    trace_path,
    trace_rank,
    trace_world_size,
)
from profiling.traces import finish_trace, link_session_view

if TYPE_CHECKING:
    from profiling.agent import TOOLS, AgentEvent, ProfilerAgent, create_agent, prepare_main_thread

__all__ = [
    "TOOLS",
    "AgentEvent",
    "ProfilerAgent",
    "create_agent",
    "finish_trace",
    "hook_env",
    "link_session_view",
    "nsys_command",
    "prepare_main_thread",
    "profile_root",
    "safe_name",
    "session_view_path",
    "trace_path",
    "trace_rank",
    "trace_world_size",
]

_LAZY = {"TOOLS": "profiling.agent", "AgentEvent": "profiling.agent",
         "ProfilerAgent": "profiling.agent", "create_agent": "profiling.agent",
         "prepare_main_thread": "profiling.agent"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'profiling' has no attribute {name!r}")
