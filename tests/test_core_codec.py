"""Records that cannot lie: the sealed frame and the tagged JSON codec."""

from __future__ import annotations

import collections
import datetime as dt
import enum
import hashlib
import json
import math
from decimal import Decimal
from typing import Any, NamedTuple
from uuid import UUID

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remit_core import CorruptRecord, VersionMismatch, codec

# -- tagged JSON ----------------------------------------------------------------------

SAMPLES: list[Any] = [
    None,
    True,
    0,
    -(2**70),
    1.5,
    "text ✓",
    [1, "a", None],
    {"a": {"b": [1, 2]}},
    (1, (2, "x")),
    {1, 2, 3},
    frozenset({"a", (1, 2)}),
    {(1, 2): "tuple key", 3: "int key", None: "none key"},
    dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc),
    dt.datetime(2026, 1, 2, 3, 4, 5),
    dt.date(2026, 1, 2),
    dt.time(3, 4, 5, 6),
    dt.timedelta(days=-1, seconds=5, microseconds=7),
    UUID("12345678-1234-5678-1234-567812345678"),
    Decimal("1234.5678900"),
    b"\x00\xffbytes",
    float("inf"),
    float("-inf"),
    {"$remit": "tuple", "v": [1, 2]},  # user data shaped like a tag stays data
    {"$remit": "x"},
    [{"$remit": "bytes", "v": "AAAA", "extra": 1}],
]


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_round_trip(value: Any) -> None:
    encoded = codec.dumps(value)
    json.loads(encoded)  # always valid JSON
    back = codec.loads(encoded)
    assert back == value and type(back) is type(value)


def test_nan_round_trips() -> None:
    assert math.isnan(codec.loads(codec.dumps(float("nan"))))


def test_bytearray_reads_back_as_bytes() -> None:
    assert codec.loads(codec.dumps(bytearray(b"ab"))) == b"ab"


def test_set_encoding_is_deterministic() -> None:
    assert codec.dumps({3, 1, 2}) == codec.dumps({2, 3, 1})


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary()
    | st.datetimes(timezones=st.none() | st.just(dt.timezone.utc))
    | st.uuids()
    | st.decimals(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=5), children, max_size=4)
        | st.dictionaries(st.integers(), children, max_size=3)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(plain)
def test_round_trip_property(value: Any) -> None:
    assert codec.loads(codec.dumps(value)) == value


class Opaque:
    pass


@pytest.mark.parametrize("value", [Opaque(), {"k": Opaque()}, [lambda: 1], object])
def test_unsupported_types_are_refused_by_name(value: Any) -> None:
    with pytest.raises(TypeError, match="cannot store a value of type"):
        codec.dumps(value)


class Colour(str, enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 2


class Pair(NamedTuple):
    left: int
    right: int


@pytest.mark.parametrize(
    ("value", "base"),
    [
        (Colour.RED, "str"),
        (Level.HIGH, "int"),
        (Pair(1, 2), "tuple"),
        (collections.OrderedDict(a=1), "dict"),
        ({"deep": [collections.defaultdict(int)]}, "dict"),
    ],
)
def test_a_subclass_that_would_read_back_as_its_base_is_refused(value: Any, base: str) -> None:
    """Stored as its base type it would come back as another value type (an Enum as
    a str): refused, naming both; `exact=False` accepts that for informational fields."""
    with pytest.raises(TypeError, match=rf"would read back as a plain builtins\.{base}"):
        codec.dumps(value)
    assert codec.loads(codec.dumps(value, exact=False)) == value  # as equal base values


def test_a_value_nested_past_the_recursion_limit_is_refused_by_name() -> None:
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(TypeError, match="nested this deeply"):
        codec.dumps(deep)


@pytest.mark.parametrize(
    "data",
    [b"{not json", b'{"$remit": "pickle", "v": "gASV"}', b'{"$remit": "os.system", "v": "ls"}'],
)
def test_loads_refuses_malformed_and_unknown_tags(data: bytes) -> None:
    with pytest.raises(ValueError):
        codec.loads(data)


# -- the sealed frame ---------------------------------------------------------------------


def test_seal_round_trip_and_identity_binding() -> None:
    body = codec.dumps({"amount": 5})
    sealed = codec.seal(body, "ckpt\x00\x00c1")
    assert sealed != body and sealed.endswith(body)
    assert codec.unseal(sealed, "ckpt\x00\x00c1") == body
    assert codec.unseal(bytearray(sealed), "ckpt\x00\x00c1") == body
    with pytest.raises(CorruptRecord) as err:
        codec.unseal(sealed, "ckpt\x00\x00c2", run_id="r1", checkpoint_id="c2")
    assert (err.value.run_id, err.value.checkpoint_id) == ("r1", "c2")
    assert "r1" in str(err.value) and "c2" in str(err.value)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda b: b[:-1] + bytes([b[-1] ^ 1]),  # body bit
        lambda b: b[:10] + bytes([b[10] ^ 0x80]) + b[11:],  # checksum bit
        lambda b: b[:-1],  # truncated body
        lambda b: b + b"x",  # appended byte
        lambda b: b[:12],  # shorter than a frame
        lambda b: b"",
        lambda b: b"XMT" + b[3:],  # not a Remit frame
    ],
)
def test_tampering_is_corrupt_record(tamper: Any) -> None:
    sealed = codec.seal(b"payload", "id")
    with pytest.raises(CorruptRecord):
        codec.unseal(tamper(sealed), "id", run_id="r", checkpoint_id="c")


def test_unknown_record_format_is_version_mismatch() -> None:
    sealed = codec.seal(b"payload", "id")
    future = sealed[:3] + bytes([codec.RECORD_FORMAT + 1]) + sealed[4:]
    with pytest.raises(VersionMismatch) as err:
        codec.unseal(future, "id", run_id="r", checkpoint_id="c")
    assert err.value.checkpoint_id == "c"


def test_format_1_records_still_read() -> None:
    """Format 1 framed records with a 16-byte BLAKE2b; they stay readable."""
    body = codec.dumps({"amount": 5})
    h = hashlib.blake2b(digest_size=16, person=b"remit-record")
    h.update(b"ckpt\x00\x00c1\x00" + body)
    v1 = b"RMT\x01" + h.digest() + body
    assert codec.unseal(v1, "ckpt\x00\x00c1") == body
    with pytest.raises(CorruptRecord):
        codec.unseal(v1, "ckpt\x00\x00c2")
    with pytest.raises(CorruptRecord):
        codec.unseal(v1[:-1] + bytes([v1[-1] ^ 1]), "ckpt\x00\x00c1")


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=64), data=st.data())
def test_any_single_bit_flip_is_detected(body: bytes, data: st.DataObject) -> None:
    sealed = codec.seal(body, f"id-{len(body)}")
    bit = data.draw(st.integers(0, len(sealed) * 8 - 1))
    flipped = bytearray(sealed)
    flipped[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises((CorruptRecord, VersionMismatch)):
        codec.unseal(bytes(flipped), f"id-{len(body)}")


def test_the_second_of_a_repeated_local_hour_keeps_its_fold() -> None:
    """A naive datetime or time with `fold=1` (what `fromtimestamp` gives in the hour
    clocks go back) reads back with it: its ISO string alone would be the first of the
    two times, an hour early. One with `fold=0` is stored as before."""
    second = dt.datetime(2021, 11, 7, 1, 30, fold=1)
    at = dt.time(1, 30, fold=1)
    back = codec.loads(codec.dumps({"at": second, "t": at, "first": second.replace(fold=0)}))
    assert (back["at"].fold, back["t"].fold, back["first"].fold) == (1, 1, 0)
    assert back == {"at": second, "t": at, "first": second.replace(fold=0)}
    assert codec.dumps(second.replace(fold=0)) == b'{"$remit":"datetime","v":"2021-11-07T01:30:00"}'
