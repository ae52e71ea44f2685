"""The standalone profiler service: schedule -> commands, trace manifest, runtime requests.

It talks to the components only through the run's streams (see ``docs/profiling.md``):

* :mod:`profiler_service.schedule`: the pure decision core (:func:`plan_sessions`,
  :func:`decide`);
* :mod:`profiler_service.manifest`: the manifest fold and its atomic write;
* :mod:`profiler_service.service`: the process (``python -m profiler_service``);
* :mod:`profiler_service.request`: the client of ``rlbus profile``.

Only the pure parts (decisions and manifest) are re-exported here; the process and the client
live in their own modules.
"""

from profiler_service.manifest import build_manifest, manifest_file, profile_dir, write_manifest
from profiler_service.schedule import decide, plan_sessions, safe_label

__all__ = [
    "build_manifest",
    "decide",
    "manifest_file",
    "plan_sessions",
    "profile_dir",
    "safe_label",
    "write_manifest",
]
