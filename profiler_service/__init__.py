"""The standalone profiler service: schedule -> commands, trace manifest, runtime requests.

It talks to the components only through the run's streams (see ``docs/profiling.md``):

* :mod:`profiler_service.state`: the service's state, ``state = fold(log)``, folded one entry
  at a time by :func:`apply` into frozen records (:mod:`profiler_service.records`;
  :mod:`profiler_service.pmap` is the persistent map that keeps each step O(1)), and
  :mod:`profiler_service.snapshot`, the folded state stored so a restart reads only the rest;
* :mod:`profiler_service.schedule`: the pure decision core (:func:`plan_sessions`,
  :func:`decide`, a function of the config and the folded state);
* :mod:`profiler_service.manifest`: the manifest, built from the folded state, and its atomic
  write;
* :mod:`profiler_service.service`: the process (``python -m profiler_service``);
* :mod:`profiler_service.request`: the client of ``rlbus profile``.

Only the pure parts (state, decisions and manifest) are re-exported here; the process and the
client live in their own modules.
"""

from profiler_service.manifest import build_manifest, manifest_file, profile_dir, write_manifest
from profiler_service.records import ServiceState
from profiler_service.schedule import decide, plan_sessions, safe_label
from profiler_service.state import apply, fold

__all__ = [
    "ServiceState",
    "apply",
    "build_manifest",
    "decide",
    "fold",
    "manifest_file",
    "plan_sessions",
    "profile_dir",
    "safe_label",
    "write_manifest",
]
