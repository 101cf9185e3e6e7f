"""What a checkpoint can hold: state values the JSON serializer stores as they are.

A checkpoint holds a run's state as the framework's `JsonSerializer` encodes it
(Remit never pickles). A value it cannot encode (a datetime or bytes in an
untyped store, an arbitrary object) would fail the commit after the step; a
value it encodes as another (a tuple read back as a list, an int dict key as a
string) would change under a recovery. Both are found here, by a round trip
through the serializer, so a write can refuse them naming the key. Pure: no
store, no event loop.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from workflows.context.serializers import JsonSerializer
from workflows.context.state_store import KNOWN_UNSERIALIZABLE_KEYS, DictState

from remit_core.errors import CheckpointInvalid


def _path(parent: str, key: object) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def _children(value: Any) -> list[tuple[object, Any]]:
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    return []


def _mismatch(value: Any, back: Any, path: str) -> tuple[str, str] | None:
    """Where `back` (a value after a store round trip) differs from `value`, and how."""
    if type(value) is not type(back):
        return path, f"a {type(value).__name__} would come back as a {type(back).__name__}"
    if isinstance(value, dict):
        if list(value) != list(back):
            odd = next((k for k in value if not isinstance(k, str)), None)
            reason = f"key {odd!r} is not a string" if odd is not None else "its keys change"
            return path, reason
        for key in value:
            found = _mismatch(value[key], back[key], _path(path, key))
            if found is not None:
                return found
        return None
    if isinstance(value, list):
        if len(value) != len(back):
            return path, "its length changes"
        for i, (a, b) in enumerate(zip(value, back, strict=True)):
            found = _mismatch(a, b, _path(path, i))
            if found is not None:
                return found
        return None
    if isinstance(value, float) and value != value and back != back:
        return None  # NaN is stored as NaN
    if value == back or type(value).__eq__ is object.__eq__:
        return None  # the same class came back; without an __eq__ identity is all it has
    return path, f"it would not read back as the same {type(value).__name__}"


def _unstorable_value(value: Any, serializer: JsonSerializer, path: str) -> tuple[str, str] | None:
    """The first part of `value` the serializer cannot store, or would store as another
    value (a tuple read back as a list, an int key as a string, a datetime it rejects)."""
    try:
        back = serializer.deserialize(serializer.serialize(value))
    except Exception:  # the framework's serializer raises ValueError, or worse
        for key, child in _children(value):
            found = _unstorable_value(child, serializer, _path(path, key))
            if found is not None:
                return found
        return path, f"a {type(value).__name__} cannot be stored as JSON"
    return _mismatch(value, back, path)


def _unstorable_entry(key: str, value: Any, serializer: JsonSerializer) -> tuple[str, str] | None:
    if key in KNOWN_UNSERIALIZABLE_KEYS:
        try:
            serializer.serialize(value)
        except Exception:  # the framework drops this key from snapshots, as documented
            return None
    return _unstorable_value(value, serializer, key)


def _unstorable_model(state: BaseModel, serializer: JsonSerializer) -> tuple[str, str] | None:
    model = type(state)
    try:
        data = json.loads(serializer.serialize(state))
    except Exception as exc:
        for name in model.model_fields:
            try:
                state.model_dump(mode="json", include={name})
            except Exception as field_exc:
                return name, f"it cannot be stored as JSON ({field_exc})"
        return "<root>", f"the state cannot be stored as JSON ({exc})"
    if not (isinstance(data, dict) and data.get("__is_pydantic")):
        return None
    try:
        back = model.model_validate(data["value"])
    except ValidationError as exc:
        first = exc.errors()[0]
        path = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
        return path, f"it does not read back as {model.__name__} ({first.get('msg')})"
    for name in model.model_fields:
        found = _mismatch(getattr(state, name), getattr(back, name), name)
        if found is not None:
            return found
    return None


def unstorable(state: BaseModel, serializer: JsonSerializer) -> tuple[str, str] | None:
    """The first key of `state` that a checkpoint cannot hold faithfully, and why.

    A checkpoint holds the state as the framework's `JsonSerializer` encodes it (never
    pickled); a value it cannot encode, or that would decode as a different value, would
    fail the commit after the step, or change under a recovery. Keys the framework
    itself drops when unserializable ("memory") are left to it.
    """
    if not isinstance(state, DictState):
        return _unstorable_model(state, serializer)
    for key, value in state.items():
        found = _unstorable_entry(key, value, serializer)
        if found is not None:
            return found
    return None


def check_storable(state: BaseModel, serializer: JsonSerializer, **ids: Any) -> None:
    """Raise `CheckpointInvalid` naming the first key of `state` a checkpoint cannot hold."""
    found = unstorable(state, serializer)
    if found is not None:
        field, reason = found
        raise CheckpointInvalid(
            f"state value at {field} cannot be stored: {reason}; store plain JSON values "
            "(str, int, float, bool, None, list, dict with str keys) or a pydantic model",
            field=field,
            **ids,
        )
