"""Message schema: every Struct of the union round-trips; bad bytes raise DecodeError."""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import validate_run_id
from runschema import messages as m

MESSAGE_TYPES: list[type] = list(typing.get_args(m.Message))

_json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def _strategy(t: mi.Type) -> st.SearchStrategy[Any]:
    """A hypothesis strategy for a msgspec type description (covers new fields for free)."""
    if isinstance(t, mi.IntType):
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**63))
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**63 - 1)
        return st.integers(lo, hi)
    if isinstance(t, mi.FloatType):
        return st.floats(allow_nan=False, min_value=t.ge, max_value=t.le)
    if isinstance(t, mi.StrType):
        if t.pattern:
            return st.from_regex(t.pattern, fullmatch=True)
        return st.text(min_size=t.min_length or 0, max_size=t.max_length or 20)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.BytesType):
        return st.binary(max_size=64)
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.AnyType):
        return _json_like
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(list(t.values))
    if isinstance(t, mi.ListType):
        return st.lists(_strategy(t.item_type), max_size=4)
    if isinstance(t, mi.DictType):
        return st.dictionaries(_strategy(t.key_type), _strategy(t.value_type), max_size=4)
    if isinstance(t, mi.TupleType):
        return st.tuples(*(_strategy(x) for x in t.item_types))
    if isinstance(t, mi.UnionType):
        return st.one_of([_strategy(x) for x in t.types])
    if isinstance(t, mi.StructType):
        return _struct_strategy(t.cls)
    raise NotImplementedError(f"no strategy for {t!r}: extend tests/test_messages.py")


def _array_strategy() -> st.SearchStrategy[m.Array]:
    dtypes = st.sampled_from(["<i4", "<f4", "<i8", "<f2", "|u1"])
    return st.builds(
        lambda dt, n, seed: m.Array.of(
            np.random.default_rng(seed).integers(0, 100, n).astype(np.dtype(dt))
        ),
        dtypes,
        st.integers(0, 16),
        st.integers(0, 2**32 - 1),
    )


def _struct_strategy(cls: type) -> st.SearchStrategy[Any]:
    if cls is m.Array:
        return _array_strategy()
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in info.fields:
        if f.name == "v":
            continue  # the schema version is not free data
        fields[f.name] = _strategy(f.type)
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


def test_every_message_type_is_covered() -> None:
    # The union is the contract: a new message type must show up here automatically.
    assert m.Sample in MESSAGE_TYPES and m.DeadLetter in MESSAGE_TYPES
    assert len({t.__name__ for t in MESSAGE_TYPES}) == len(MESSAGE_TYPES)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip(cls: type, data: st.DataObject) -> None:
    msg = data.draw(_struct_strategy(cls))
    raw = m.encode(msg)
    assert isinstance(raw, bytes)
    back = m.decode(raw)
    assert type(back) is cls
    assert back == msg
    assert back.v == m.SCHEMA_VERSION


def test_array_is_raw_little_endian() -> None:
    a = m.Array.of(np.arange(4, dtype=">i4"))
    assert a.dtype == "<i4"
    assert a.data == np.arange(4, dtype="<i4").tobytes()
    assert list(a.numpy()) == [0, 1, 2, 3]
    assert len(a) == 4


def _sample() -> m.Sample:
    return m.Sample(
        sample_id="t/0",
        ticket_id="t",
        prompt_id="p",
        index=0,
        n=1,
        prompt_tokens=m.Array.of(np.arange(64, dtype=np.int32)),
        response_tokens=m.Array.of(np.arange(256, dtype=np.int32)),
        logprobs=m.Array.of(np.zeros(256, dtype=np.float32)),
        reward=1.0,
        min_version=0,
        max_version=0,
    )


def test_sample_size_is_about_2_4_kb() -> None:
    # The benchmark's premise: arrays travel as bytes, not msgpack lists.
    assert 2200 < len(m.encode(_sample())) < 2700


def _expect_decode_error(raw: bytes | None, *needles: str) -> str:
    with pytest.raises(m.DecodeError) as info:
        m.decode(raw)
    reason = info.value.reason
    assert reason and str(info.value) == reason
    for needle in needles:
        assert needle in reason, reason
    return reason


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", b"\xff\x00\x13garbage", b"\x92\x01", bytes(range(256))],
    ids=["empty", "reserved-byte", "junk", "array", "all-bytes"],
)
def test_garbage_bytes_raise(raw: bytes) -> None:
    _expect_decode_error(raw)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(raw: bytes) -> None:
    try:
        msg = m.decode(raw)
    except m.DecodeError as exc:
        assert exc.reason
    else:
        assert isinstance(msg, tuple(MESSAGE_TYPES))


def test_unknown_type_tag() -> None:
    raw = msgspec.msgpack.encode({"type": "NoSuchMessage", "v": 1})
    _expect_decode_error(raw, "NoSuchMessage")


def test_future_schema_version() -> None:
    raw = msgspec.msgpack.encode(
        {"type": "StepStarted", "v": m.SCHEMA_VERSION + 1, "step": 1, "param_version": 0}
    )
    _expect_decode_error(raw, "StepStarted", "newer", str(m.SCHEMA_VERSION + 1))


def test_invalid_schema_version() -> None:
    raw = msgspec.msgpack.encode({"type": "StepStarted", "v": 0, "step": 1, "param_version": 0})
    _expect_decode_error(raw, "invalid schema version")


def test_missing_required_field() -> None:
    raw = msgspec.msgpack.encode({"type": "StepStarted", "v": 1, "param_version": 0})
    _expect_decode_error(raw, "step")


def test_wrong_field_type() -> None:
    raw = msgspec.msgpack.encode({"type": "StepStarted", "v": 1, "step": "one", "param_version": 0})
    _expect_decode_error(raw, "step")


def test_missing_field_value() -> None:
    _expect_decode_error(None, m.FIELD.decode())


def test_unknown_extra_fields_are_ignored() -> None:
    # Forward compatibility within a version: an added field with a default is harmless.
    raw = msgspec.msgpack.encode(
        {"type": "StepStarted", "v": 1, "step": 3, "param_version": 2, "new_thing": [1]}
    )
    msg = m.decode(raw)
    assert isinstance(msg, m.StepStarted) and msg.step == 3


def test_bus_reexports_every_public_name() -> None:
    import importlib

    import bus

    for name in ("acl", "errors", "keys", "liveness", "ranks", "retry", "streams", "urls"):
        module = importlib.import_module(f"bus.{name}")
        missing = set(module.__all__) - set(bus.__all__)
        assert not missing, f"bus/__init__.py does not re-export bus.{name}: {sorted(missing)}"
        for public in module.__all__:
            assert getattr(bus, public) is getattr(module, public)


@pytest.mark.parametrize("run_id", ["", "-a", "a/b", "a b", "a" * 65, "run\n", "r\x00"])
def test_a_run_id_that_is_not_a_safe_name_is_refused(run_id: str) -> None:
    """A run id is part of every key and a folder name: letters, digits, '_.-' only, the
    whole string (a final newline too)."""
    with pytest.raises(ValueError, match="run id"):
        validate_run_id(run_id)
    assert validate_run_id("run-20261203_1.a") == "run-20261203_1.a"
