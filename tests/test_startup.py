"""What `rlbus up` loads before it starts the components (their imports overlap its own)."""

from __future__ import annotations

import subprocess
import sys

import bus


def test_every_public_bus_name_resolves() -> None:
    """bus loads its submodules on first use: each name in __all__ must be found."""
    assert [n for n in bus.__all__ if getattr(bus, n, None) is None] == []


def test_the_launcher_loads_no_redis_client_numpy_or_torch() -> None:
    code = (
        "import sys, rlbus.cli, rlbus.launcher\n"
        "print(' '.join(m for m in ('redis', 'numpy', 'torch', 'bus.streams', 'runschema.messages')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "", f"loaded before the components start: {out.stdout}"


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout.strip()


def test_trainer_and_rollouter_start_with_the_collector_off() -> None:
    """Their start-up objects (torch, the model) live as long as the process: no collector
    passes over them until the component is built (settle_heap turns it back on). The
    runtime's last step before the event loop stands in for it here: the component class is
    loaded (torch imported) by then, and `rlbus ROLE` and `python -m ROLE` share the path."""
    code = (
        "import gc, sys, rlbus.cli, runtime.process\n"
        "async def serve(cfg, url, prog, factory):\n"
        "    print(gc.isenabled(), 'torch' in sys.modules)\n"
        "    return 0\n"
        "runtime.process._serve = serve\n"
        "rlbus.cli._component({name!r}, ['redis.url=redis://127.0.0.1:1/0', 'run.id=r'])\n"
    )
    for name in ("trainer", "rollouter"):
        assert _run(code.format(name=name)) == "False True", name
    assert _run(code.format(name="logger")).endswith("True False")


def test_settle_heap_freezes_start_up_objects_and_turns_the_collector_on() -> None:
    code = (
        "import gc\nfrom runtime import settle_heap\n{before}\nsettle_heap()\n"
        "print(gc.isenabled(), gc.get_freeze_count() > 0)\n"
    )
    assert _run(code.format(before="gc.disable()")) == "True True"
    # Started otherwise (in-process, the collector on): left exactly as it is.
    assert _run(code.format(before="")) == "True False"
