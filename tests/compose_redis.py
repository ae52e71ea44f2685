"""A redis-server >= 7 started the way docker-compose.yml starts it: deploy/redis/start-redis.sh
renders deploy/redis/users.acl with passwords from the environment (the test's own)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import redis

from rlbus.redis_binary import free_port
from tests.waits import Watched, wait_until_blocking

__all__ = ["ROOT", "USERS", "AclRedis", "acl_env", "interpolate", "local_argv", "password"]

ROOT = Path(__file__).resolve().parents[1]
USERS = ("admin", "trainer", "rollouter", "profiler", "logger", "operator")


def password(user: str) -> str:
    return f"test-{user}-pw-Zq7"


def acl_env(run_id: str) -> dict[str, str]:
    env = {f"RLBUS_{u.upper()}_PASSWORD": password(u) for u in USERS}
    env["RLBUS_RUN_ID"] = run_id
    return env


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([-?])([^}]*))?\}")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's interpolation: ``$$`` is a literal ``$``; ``${VAR}``, ``${VAR:-default}``,
    ``${VAR:?error}``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == "-" else ""

    return _VAR.sub(sub, value)


def local_argv(command: Sequence[str], env: Mapping[str, str], host: str, port: int,
               out: Path) -> list[str]:
    """A compose service's ``command`` as a local process runs it: interpolated as compose
    would, Redis at ``host:6379`` (the compose network's name) replaced by 127.0.0.1:``port``,
    ``run.output_dir`` by ``out``."""
    argv = [interpolate(a, env).replace(f"@{host}:6379/", f"@127.0.0.1:{port}/")
            for a in command]
    return [f"run.output_dir={out}" if a.startswith("run.output_dir=") else a for a in argv]


class AclRedis:
    """The server of docker-compose.yml's redis service, on a free loopback port."""

    def __init__(self, binary: str, dir: Path, run_id: str, extra: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        """``extra``: more redis-server arguments; ``env``: more of the script's
        environment (``RLBUS_REDIS_CLUSTER=yes`` for a cluster node)."""
        self.port = free_port()
        self.run_id = run_id
        dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **acl_env(run_id), "RLBUS_ACL_OUT": str(dir / "users.acl"),
               **(env or {})}
        with (dir / "redis.log").open("wb") as log:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                ["sh", str(ROOT / "deploy" / "redis" / "start-redis.sh"), binary,
                 "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(dir), *extra],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )
        server = Watched("redis-server (start-redis.sh)", self.proc, dir / "redis.log")
        client = redis.Redis(port=self.port, socket_timeout=5)

        def answers() -> bool | None:
            # The default user may PING, as the compose healthcheck does.
            try:
                return client.ping() or None
            except redis.ConnectionError:
                if server.poll() is not None:
                    raise AssertionError(f"redis-server exited\n{server.describe()}") from None
                return None

        try:
            wait_until_blocking(answers, f"redis-server to answer PING on port {self.port}", 30)
        finally:
            client.close()

    def url(self, user: str, pw: str | None = None) -> str:
        return f"redis://{user}:{pw or password(user)}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis(port=self.port, username=user, password=password(user),
                           socket_timeout=10)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
