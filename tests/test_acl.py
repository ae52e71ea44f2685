"""The compose stack's ACLs bite: each component user can do its own job and nothing else."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bus import RunKeys, acl_file
from runconfig import config_to_dict, load_config
from runschema.messages import RunStarted, encode
from tests.compose_redis import ROOT, AclRedis
from tests.procs import run_cli

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
    _denied(lambda: c.xadd(KEYS.events, {"m": b"RunFinished"}))  # the trainer's facts
    # What it needs: claim tickets, publish samples and its own facts, read the log, control
    # and weights.
    c.xgroup_create(KEYS.prompts, "rollouter", id="0", mkstream=True)
    got = c.xreadgroup("rollouter", "r0", {KEYS.prompts: ">"}, count=1)
    c.xack(KEYS.prompts, "rollouter", got[0][1][0][0])
    c.xadd(KEYS.samples, {"m": b"sample"})
    c.xadd(KEYS.log("rollouter"), {"m": b"event"})
    c.xread({KEYS.control: "0", KEYS.events: "0", KEYS.log("rollouter"): "0"})
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
    _denied(lambda: c.xadd(KEYS.log("rollouter"), {"m": b"ValidationFinished"}))
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


def test_the_acl_file_is_what_bus_acl_generates() -> None:
    assert (ROOT / "deploy" / "redis" / "users.acl").read_text() == acl_file(), (
        "deploy/redis/users.acl is stale: run .venv/bin/python -m bus.acl > "
        "deploy/redis/users.acl")


def _dryrun(admin: redis.Redis, user: str, *command: Any) -> bool:
    """Whether ``user`` may run ``command`` (ACL DRYRUN: nothing is executed)."""
    try:
        reply = admin.execute_command("ACL", "DRYRUN", user, *command)
    except redis.exceptions.ResponseError:
        return False
    return reply in (b"OK", "OK")


# What the forgeries of issue 22 need, refused for every user but the trainer (and admin).
FORGERIES: dict[str, tuple[Any, ...]] = {
    "append a trainer fact": ("XADD", KEYS.events, "*", "m", "x"),
    "replace the log by a string": ("SET", KEYS.events, "x"),
    "expire the samples": ("PEXPIRE", KEYS.samples, 1),
    "delete the log": ("DEL", KEYS.events),
    "fake the trainer's pulse": ("SET", KEYS.alive("trainer", 0), "x"),
    "list every run's keys": ("SCAN", 0),
    "take the trainer's lease": ("SET", KEYS.trainer_lease, "x"),
    "append to another role's stream": ("XADD", KEYS.log("profiler"), "*", "m", "x"),
}


@pytest.mark.parametrize("user", ["rollouter", "logger", "operator"])
@pytest.mark.parametrize("what", sorted(FORGERIES))
def test_no_other_role_may_forge_the_trainers_facts(server: AclRedis, user: str, what: str,
                                                    ) -> None:
    admin = server.client("admin")
    assert not _dryrun(admin, user, *FORGERIES[what]), f"{user} may {what}"
    admin.close()


@pytest.mark.parametrize("what", sorted(set(FORGERIES) - {"append to another role's stream"}))
def test_the_profiler_may_not_forge_either(server: AclRedis, what: str) -> None:
    admin = server.client("admin")
    assert not _dryrun(admin, "profiler", *FORGERIES[what]), f"profiler may {what}"
    assert not _dryrun(admin, "profiler", "XADD", KEYS.log("rollouter"), "*", "m", "x")
    admin.close()


@pytest.mark.parametrize("user", (*COMPONENTS, "operator"))
def test_each_role_appends_to_its_own_stream_of_the_log_only(server: AclRedis, user: str,
                                                             ) -> None:
    admin = server.client("admin")
    own = KEYS.log(user)
    assert _dryrun(admin, user, "XADD", own, "*", "m", "x")
    for role in ("trainer", "rollouter", "profiler", "logger", "operator"):
        if role != user:
            assert not _dryrun(admin, user, "XADD", KEYS.log(role), "*", "m", "x"), (user, role)
        assert not _dryrun(admin, user, "SET", KEYS.log(role), "x"), (user, role)
    # Every component reads the whole log in one XREAD.
    streams = [KEYS.log(r) for r in ("trainer", "rollouter", "profiler")]
    assert _dryrun(admin, user, "XREAD", "STREAMS", *streams, *["0"] * len(streams))
    admin.close()


@pytest.mark.procs
@pytest.mark.parametrize("command", ["inspect", "profile"])
def test_a_missing_right_is_one_line_naming_it(server: AclRedis, tmp_path: Path,
                                                command: str) -> None:
    """The logger's user may not read the samples (inspect --trace reads them) nor append a
    request (rlbus profile): one line naming the refused right, never a traceback."""
    admin = server.client("admin")
    cfg = config_to_dict(load_config(None, [f"run.id={RUN}", "global_profiler.tool=torch"]))
    admin.xadd(KEYS.events, {"m": encode(RunStarted(run_id=RUN, config=cfg))})
    admin.close()
    url = f"redis.url={server.url('logger')}"
    args = (["inspect", "--run", RUN, "--trace", str(tmp_path / "t.json"), url]
            if command == "inspect" else ["profile", "--run", RUN, "--steps", "next:1", url])
    res = run_cli(*args)
    assert res.returncode != 0, res.stdout
    assert "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "no permissions" in lines[0] and "logger" in lines[0], res.stderr


@pytest.mark.procs
def test_the_operator_inspects_and_asks_for_a_profile(server: AclRedis, tmp_path: Path) -> None:
    """Every rlbus command an operator runs works with the operator's user: inspect (the
    whole log, the samples for --trace) and profile (its request in its own stream; no
    profiler service answers here, so it withdraws the request after its timeout)."""
    admin = server.client("admin")
    cfg = config_to_dict(load_config(None, [f"run.id={RUN}", "global_profiler.tool=torch"]))
    admin.xadd(KEYS.events, {"m": encode(RunStarted(run_id=RUN, config=cfg))})
    admin.close()
    url = f"redis.url={server.url('operator')}"
    shown = run_cli("inspect", "--run", RUN, "--json", url)
    assert shown.returncode == 0, shown.stderr
    assert '"type": "RunStarted"' in shown.stdout or '"type":"RunStarted"' in shown.stdout
    traced = run_cli("inspect", "--run", RUN, "--trace", str(tmp_path / "t.json"), url)
    assert traced.returncode == 0, traced.stderr
    asked = run_cli("profile", "--run", RUN, "--steps", "next:1", "--timeout", "1", url)
    assert asked.returncode == 1 and "withdrawn" in asked.stderr, asked.stderr
    assert "Traceback" not in asked.stderr
    admin = server.client("admin")
    requests = admin.xrange(KEYS.log("operator"))
    admin.close()
    assert len(requests) == 2  # the request, then its withdrawal
