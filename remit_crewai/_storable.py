"""What a checkpoint's state may hold: values Remit's codec reads back as themselves.

The codec (`remit_core.codec`) stores plain data, tags the types JSON lacks,
and never runs code or imports a name to read a value back. A subclass of a
type it knows (a str or int Enum, a namedtuple, an OrderedDict or defaultdict,
a bytearray) it stores as that type, and a datetime's time zone as its offset
at that moment, so after a restart the value would come back changed (a zone
with daylight saving would lose its rules); any other type it refuses.
`inexact` finds the first such part of a state, by type, before anything is
stored, so that a save can refuse it naming the key; `same` tells whether a
value read back is the value written, types included (a str Enum member
equals its string). Pure: no I/O.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any
from uuid import UUID

#: Types the codec reads back as the same type and value: exactly these, not subclasses.
_SCALARS = frozenset(
    {str, int, float, bool, type(None), bytes, dt.date, dt.timedelta, UUID, Decimal}
)
_SEQUENCES = frozenset({list, tuple, set, frozenset})


def _key_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def inexact(value: Any, path: str = "") -> tuple[str, type] | None:
    """The path (`a.b[2]`, `<root>` for `value` itself) and type of the first part of
    `value` that the codec would not read back as the same type and value, or None."""
    cls = type(value)
    if cls in _SCALARS:
        return None
    if cls is dt.datetime or cls is dt.time:
        zone = value.tzinfo
        # A fixed offset (its utcoffset needs no date) is all an ISO string keeps.
        if zone is None or zone.utcoffset(None) is not None:
            return None
        return path or "<root>", type(zone)
    if cls is dict:
        for key, item in value.items():
            where = _key_path(path, key)
            found = inexact(key, where) or inexact(item, where)
            if found is not None:
                return found
        return None
    if cls in _SEQUENCES:
        for i, item in enumerate(value):
            found = inexact(item, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return path or "<root>", cls


def same(a: Any, b: Any, *, widened: bool = False) -> bool:
    """Whether `b` is `a`: equal, of the same types all the way down, with the same zone.

    `widened`: `b` may hold a float or Decimal where `a` holds an int that is exactly that
    number (a model's reading of an int a step assigned to a float or Decimal field)."""
    cls = type(a)
    if widened and cls is int and type(b) in (float, Decimal):
        return bool(a == b)
    if cls is not type(b):
        return False
    if cls is dict:
        return list(a) == list(b) and all(
            same(k, j) and same(a[k], b[j], widened=widened) for k, j in zip(a, b, strict=True)
        )
    if cls is list or cls is tuple:
        return len(a) == len(b) and all(
            same(x, y, widened=widened) for x, y in zip(a, b, strict=True)
        )
    if cls is set or cls is frozenset:
        return {(type(x), x) for x in a} == {(type(y), y) for y in b}
    if cls is dt.datetime or cls is dt.time:
        same_fold = a.fold == b.fold  # `==` ignores it between naive values
        return a == b and same_fold and a.utcoffset() == b.utcoffset() and inexact(a) is None
    if cls is float and a != a:
        return b != b  # NaN
    if cls is Decimal and (a.is_nan() or b.is_nan()):
        # A NaN equals nothing, and a signalling one raises when compared: its text
        # (kind, sign, payload) is what the codec keeps.
        return str(a) == str(b)
    return bool(a == b)


def type_name(cls: type) -> str:
    """`cls` as a user finds it in their code (`module.Qualname`, builtins bare)."""
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"
