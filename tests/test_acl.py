"""The compose stack's ACLs bite: each component user can do its own job and nothing else."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bus import RunKeys
from tests.compose_redis import AclRedis

RUN = "acl-run"
OTHER = RunKeys("someone-else")
KEYS = RunKeys(RUN)
COMPONENTS = ("trainer", "rollouter", "profiler", "logger")


@pytest.fixture(scope="module")
def server(redis7_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    srv = AclRedis(redis7_binary, tmp_path_factory.mktemp("acl"), RUN)
    try:
        yield srv
    finally:
        srv.stop()


def _denied(fn: Callable[[], Any]) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        fn()


def test_rollouter_cannot_write_control_or_prompts_but_does_its_job(server: AclRedis) -> None:
    admin, c = server.client("admin"), server.client("rollouter")
    admin.xadd(KEYS.prompts, {"m": b"ticket"})
    _denied(lambda: c.xadd(KEYS.control, {"m": b"StartProfile"}))
    _denied(lambda: c.xadd(KEYS.prompts, {"m": b"forged ticket"}))
    _denied(lambda: c.set(KEYS.barrier, 99))
    _denied(lambda: c.delete(KEYS.events))
    # What it needs: claim tickets, publish samples and events, read control and weights.
    c.xgroup_create(KEYS.prompts, "rollouter", id="0", mkstream=True)
    got = c.xreadgroup("rollouter", "r0", {KEYS.prompts: ">"}, count=1)
    c.xack(KEYS.prompts, "rollouter", got[0][1][0][0])
    c.xadd(KEYS.samples, {"m": b"sample"})
    c.xadd(KEYS.events, {"m": b"event"})
    c.xread({KEYS.control: "0"})
    c.mget([KEYS.blob("weights-v0") + ":0"])
    c.set(KEYS.alive("rollouter", 0), b"hb", px=3000)
    c.close()
    admin.close()


def test_profiler_cannot_read_samples_nor_move_the_barrier(server: AclRedis) -> None:
    c = server.client("profiler")
    _denied(lambda: c.xrange(KEYS.samples))
    _denied(lambda: c.xread({KEYS.samples: "0"}))
    _denied(lambda: c.set(KEYS.barrier, 1))
    _denied(lambda: c.xadd(KEYS.prompts, {"m": b"x"}))
    # Its guarded publish: one script reading the barrier and appending to control.
    guarded = "redis.call('GET', KEYS[2]); return redis.call('XADD', KEYS[1], '*', 'm', 'x')"
    assert c.eval(guarded, 2, KEYS.control, KEYS.barrier)
    with pytest.raises(redis.exceptions.ResponseError):  # no SET through a script either
        c.eval("return redis.call('SET', KEYS[1], 1)", 1, KEYS.barrier)
    c.close()


def test_logger_only_reads_events(server: AclRedis) -> None:
    c = server.client("logger")
    c.xrange(KEYS.events)
    _denied(lambda: c.xadd(KEYS.events, {"m": b"WeightsPublished"}))
    _denied(lambda: c.xrange(KEYS.samples))
    c.close()


@pytest.mark.parametrize("user", COMPONENTS)
def test_no_component_user_can_flush_configure_or_touch_another_run(
    server: AclRedis, user: str
) -> None:
    c = server.client(user)
    _denied(lambda: c.flushall())
    _denied(lambda: c.config_get("*"))
    _denied(lambda: c.delete(OTHER.events))
    _denied(lambda: c.xadd(OTHER.events, {"m": b"x"}))
    _denied(lambda: c.keys("*"))
    c.close()


def test_wrong_password_and_the_default_user_are_refused(server: AclRedis, tmp_path: Path) -> None:
    anonymous = redis.Redis(port=server.port, socket_timeout=10)
    assert anonymous.ping()  # the compose healthcheck
    _denied(lambda: anonymous.get(KEYS.barrier))
    anonymous.close()
    wrong = redis.Redis(port=server.port, username="trainer", password="nope", socket_timeout=10)
    with pytest.raises(redis.exceptions.AuthenticationError):
        wrong.ping()
    wrong.close()
