"""Records that cannot lie: a sealed envelope, and a JSON codec that runs no code.

`seal` frames a payload with a record-format version and a CRC-32 over the
record's identity and bytes, so altered bytes, a payload moved to another
row of its run, or an unknown format all fail loudly in `unseal`. The
identity leaves the run id out, so that a run copies byte for byte
(`copy_run`): a payload moved to the same row of another run is not caught. The checksum guards
against corruption, not against someone who can write the store: such a
writer could recompute any unkeyed digest. Records of format 1 (a 16-byte
BLAKE2b instead of the CRC) are still read.

`dumps` / `loads` encode plain Python values as JSON with explicit tags for
the types JSON lacks (datetime and time with their `fold`, date, timedelta,
UUID, Decimal, bytes, tuple, set, frozenset, non-string dict keys). Anything else, and a subclass
of these that would read back as its base type, is refused at write time with
`TypeError`; reading never imports or calls anything.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import sys
import zlib
from decimal import Decimal
from typing import Any
from uuid import UUID

from remit_core.errors import CorruptRecord, VersionMismatch

#: Record format version written, part of the 4-byte magic.
RECORD_FORMAT = 2
_MAGIC = b"RMT" + bytes([RECORD_FORMAT])
_CRC_HEADER = len(_MAGIC) + 4
_V1_HEADER = len(_MAGIC) + 16


def _crc(identity: str, body: bytes) -> bytes:
    return zlib.crc32(body, zlib.crc32(identity.encode() + b"\x00")).to_bytes(4, "big")


def _v1_digest(identity: str, body: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=b"remit-record")
    h.update(identity.encode())
    h.update(b"\x00")
    h.update(body)
    return h.digest()


def seal(body: bytes, identity: str) -> bytes:
    """Frame `body` for storage; `identity` names the row it belongs to."""
    return _MAGIC + _crc(identity, body) + body


def peek(blob: bytes) -> bytes:
    """The body of a frame, unchecked: enough to tell whose a damaged record is."""
    if blob[:3] != b"RMT":
        return b""
    return bytes(blob[_V1_HEADER if blob[3] == 1 else _CRC_HEADER :])


def unseal(blob: bytes, identity: str, /, **ids: Any) -> bytes:
    """Check and strip the frame; `ids` name the record in the error."""
    if len(blob) < _CRC_HEADER or blob[:3] != b"RMT":
        raise CorruptRecord("stored record has no Remit frame", **ids)
    fmt = blob[3]
    if fmt == RECORD_FORMAT:
        body = bytes(blob[_CRC_HEADER:])
        ok = blob[4:_CRC_HEADER] == _crc(identity, body)
    elif fmt == 1:
        if len(blob) < _V1_HEADER:
            raise CorruptRecord("stored record has no Remit frame", **ids)
        body = bytes(blob[_V1_HEADER:])
        ok = blob[4:_V1_HEADER] == _v1_digest(identity, body)
    else:
        raise VersionMismatch(
            f"stored record has format {fmt}, this Remit reads 1 and {RECORD_FORMAT}", **ids
        )
    if not ok:
        raise CorruptRecord("stored record failed its checksum", **ids)
    return body


_TAG = "$remit"


#: Exact types that encode as themselves (subclasses take the slow path below).
_AS_IS = frozenset({str, int, bool, type(None)})
#: The other types stored as themselves (and bytearray, read back as the bytes it equals).
_EXACT = frozenset(
    {float, list, dict, tuple, set, frozenset, bytes, bytearray}
    | {dt.datetime, dt.date, dt.time, dt.timedelta, UUID, Decimal}
)
#: Bases whose subclasses (a str or int Enum, a namedtuple, an OrderedDict) would read
#: back as the base: refused unless the caller accepts that (`dumps(exact=False)`).
_BASES: tuple[type, ...] = (bool, int, str, float, list, dict, tuple, set, frozenset, bytes)
_BASES += (dt.datetime, dt.date, dt.time, dt.timedelta, UUID, Decimal)


def _encode(value: Any, exact: bool = True) -> Any:
    cls = type(value)
    if cls in _AS_IS:
        return value
    if cls is dict and _TAG not in value:
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                break
            out[k] = v if type(v) in _AS_IS else _encode(v, exact)
        else:
            return out
    elif cls is list:
        return [v if type(v) in _AS_IS else _encode(v, exact) for v in value]
    if exact and cls not in _EXACT and isinstance(value, _BASES):
        base = next(b for b in _BASES if isinstance(value, b))
        raise TypeError(
            f"Remit cannot store a value of type {cls.__module__}.{cls.__qualname__} as it "
            f"is: it would read back as a plain {base.__module__}.{base.__qualname__}; "
            "store the plain value (an Enum's .value, a namedtuple's ._asdict())"
        )
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return {_TAG: "float", "v": repr(value)}
        return value
    if isinstance(value, list):
        return [_encode(v, exact) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _encode(v, exact) for k, v in value.items()}
        return {
            _TAG: "dict",
            "v": [[_encode(k, exact), _encode(v, exact)] for k, v in value.items()],
        }
    if isinstance(value, tuple):
        return {_TAG: "tuple", "v": [_encode(v, exact) for v in value]}
    if isinstance(value, (set, frozenset)):
        items = sorted(
            (_encode(v, exact) for v in value), key=lambda e: json.dumps(e, sort_keys=True)
        )
        return {_TAG: type(value).__name__, "v": items}
    if isinstance(value, dt.datetime):
        # An ISO string keeps no `fold`: the second of a repeated local hour (what
        # `fromtimestamp` gives as clocks go back) has a tag of its own.
        return {_TAG: "datetime.fold" if value.fold else "datetime", "v": value.isoformat()}
    if isinstance(value, dt.date):
        return {_TAG: "date", "v": value.isoformat()}
    if isinstance(value, dt.time):
        return {_TAG: "time.fold" if value.fold else "time", "v": value.isoformat()}
    if isinstance(value, dt.timedelta):
        return {_TAG: "timedelta", "v": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, UUID):
        return {_TAG: "uuid", "v": str(value)}
    if isinstance(value, Decimal):
        return {_TAG: "decimal", "v": str(value)}
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "v": base64.b64encode(bytes(value)).decode()}
    raise TypeError(
        f"Remit cannot store a value of type {type(value).__module__}.{type(value).__qualname__}; "
        "convert it to plain data (dict, list, str, int, float, bool, None, datetime, UUID, "
        "Decimal, bytes, tuple, set) or declare a state schema that dumps it"
    )


def _decode_tagged(tag: str, v: Any) -> Any:
    if tag == "dict":
        return {_freeze(_decode(k)): _decode(x) for k, x in v}
    if tag == "tuple":
        return tuple(_decode(x) for x in v)
    if tag == "set":
        return {_freeze(_decode(x)) for x in v}
    if tag == "frozenset":
        return frozenset(_freeze(_decode(x)) for x in v)
    if tag == "datetime":
        return dt.datetime.fromisoformat(v)
    if tag == "datetime.fold":
        return dt.datetime.fromisoformat(v).replace(fold=1)
    if tag == "date":
        return dt.date.fromisoformat(v)
    if tag == "time":
        return dt.time.fromisoformat(v)
    if tag == "time.fold":
        return dt.time.fromisoformat(v).replace(fold=1)
    if tag == "timedelta":
        return dt.timedelta(days=v[0], seconds=v[1], microseconds=v[2])
    if tag == "uuid":
        return UUID(v)
    if tag == "decimal":
        return Decimal(v)
    if tag == "bytes":
        return base64.b64decode(v, validate=True)
    if tag == "float":
        return float(v)
    raise ValueError(f"unknown tag {tag!r}")


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _decode(value: Any) -> Any:
    # json.loads gives exact dicts and lists; only they can hold a tag.
    cls = type(value)
    if cls is list:
        return [_decode(v) if type(v) in _NESTED else v for v in value]
    if cls is dict:
        tag = value.get(_TAG)
        if isinstance(tag, str) and len(value) == 2 and "v" in value:
            return _decode_tagged(tag, value["v"])
        return {k: _decode(v) if type(v) in _NESTED else v for k, v in value.items()}
    return value


_NESTED = frozenset({dict, list})


def dumps(value: Any, *, exact: bool = True) -> bytes:
    """Encode plain data as tagged JSON bytes; `TypeError` names an unsupported type.

    A subclass of a supported type (a str Enum, a namedtuple) is refused too, as it
    would read back as its base type; `exact=False` stores it as its base (for
    fields that are only informational, such as checkpoint metadata).
    """
    if type(value) is dict and not value:  # empty metadata, the common case
        return b"{}"
    try:
        return json.dumps(_encode(value, exact), separators=(",", ":"), allow_nan=False).encode()
    except RecursionError:
        raise TypeError(
            "Remit cannot store a value nested this deeply (its encoding goes past Python's "
            "recursion limit)"
        ) from None
    except ValueError as exc:  # the one left: an int past Python's digit limit for text
        raise ValueError(
            "Remit cannot store an int of more digits than Python converts to text "
            f"({sys.get_int_max_str_digits()}): a reader could not read it back; store "
            "such a number as text or bytes"
        ) from exc


def loads(data: bytes) -> Any:
    """Decode bytes made by `dumps`. Raises `ValueError` on malformed input, a
    tagged value of the wrong shape included (as stored metadata may hold)."""
    if data == b"{}":
        return {}
    try:
        return _decode(json.loads(data))
    except (TypeError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
        raise ValueError(f"malformed Remit value: {type(exc).__name__}: {exc}") from exc
