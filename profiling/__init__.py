"""Profiling shared by the trainer and the rollouter: the in-process profiler agent.

Components import this package, never each other. With profiling off they create no agent
(:func:`create_agent` returns ``None``). The agent does no bus I/O: the component feeds it the
control commands it read and publishes the events it returns.
"""

from profiling.agent import TOOLS, AgentEvent, ProfilerAgent, create_agent
from profiling.paths import profile_root, safe_name, trace_path

__all__ = [
    "TOOLS",
    "AgentEvent",
    "ProfilerAgent",
    "create_agent",
    "profile_root",
    "safe_name",
    "trace_path",
]
