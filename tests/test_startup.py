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
        "print(' '.join(m for m in ('redis', 'numpy', 'torch', 'bus.streams', 'bus.messages')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "", f"loaded before the components start: {out.stdout}"
