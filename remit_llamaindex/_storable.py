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

import dataclasses
import json
from enum import Enum
from typing import Any

from pydantic import BaseModel, ValidationError
from workflows.context.serializers import JsonSerializer
from workflows.context.state_store import KNOWN_UNSERIALIZABLE_KEYS, DictState, set_by_path_copy

from remit_core.errors import CheckpointInvalid
from remit_core.schema import StateSchema


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


_TOO_DEEP = "it is nested too deeply to be stored as JSON"


def _too_deep(exc: BaseException | None) -> bool:
    """Whether `exc` came of Python's recursion limit (the framework's serializer raises
    it as a `ValueError` whose context is the `RecursionError`)."""
    while exc is not None:
        if isinstance(exc, RecursionError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _is_too_deep(value: Any, serializer: JsonSerializer) -> bool:
    """Whether the serializer fails on `value` for its depth alone."""
    try:
        serializer.serialize(value)
    except Exception as exc:  # the framework's serializer raises ValueError, or worse
        return _too_deep(exc)
    return False


def _unstorable_value(value: Any, serializer: JsonSerializer, path: str) -> tuple[str, str] | None:
    """The first part of `value` the serializer cannot store, or would store as another
    value (a tuple read back as a list, an int key as a string, a datetime it rejects)."""
    try:
        back = serializer.deserialize(serializer.serialize(value))
    except Exception as exc:  # the framework's serializer raises ValueError, or worse
        if _too_deep(exc):
            # Named at this key: looking deeper for the part that fails would recurse
            # as deep, and fail with a bare RecursionError.
            return path, _TOO_DEEP
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
                # Both halves of the serializer's encoding: the dump refuses bytes that
                # are not text, the JSON text an int of more digits than it converts.
                json.dumps(state.model_dump(mode="json", include={name}))
            except Exception as field_exc:
                if _is_too_deep(getattr(state, name), serializer):
                    return name, _TOO_DEEP
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


_MISSING = object()


def _event_values(event: BaseModel) -> list[tuple[str, Any, Any]]:
    """(name, value, how to read it from a decoded copy) of every field of `event`:
    its declared fields, then the undeclared ones a framework `Event` keeps in `_data`."""
    fields = list(type(event).model_fields)
    values: list[tuple[str, Any, Any]] = [
        (name, getattr(event, name), lambda e, n=name: getattr(e, n, _MISSING)) for name in fields
    ]
    data = getattr(event, "_data", None)
    if isinstance(data, dict):
        values.extend(
            (key, value, lambda e, k=key: getattr(e, "_data", {}).get(k, _MISSING))
            for key, value in data.items()
            if key not in fields
        )
    return values


def unstorable_event(event: BaseModel, serializer: JsonSerializer) -> tuple[str, str] | None:
    """The first field of `event` that the store cannot hold as it is, and why.

    A resume value is stored with its interrupt and a recovery continues with the
    stored copy: a value that decodes as another (a tuple or set read back as a list,
    bytes or a datetime held untyped read back as a string, a class the serializer
    does not resolve) would reach a recovered run as a different value than the one
    acknowledged to its sender."""
    try:
        back = serializer.deserialize(serializer.serialize(event))
    except Exception as exc:  # the framework's serializer raises ValueError, or worse
        for name, value, _ in _event_values(event):
            found = _unstorable_value(value, serializer, name)
            if found is not None:
                return found
        return "<root>", f"the event cannot be stored as JSON ({exc})"
    if type(back) is not type(event):
        return "<root>", f"a {type(event).__name__} would come back as a {type(back).__name__}"
    for name, value, read in _event_values(event):
        found = _mismatch(value, read(back), name)
        if found is not None:
            return found
    return _unstored_private(event, back)


#: Private attributes of the framework's events that its serializer does store.
_STORED_PRIVATE = frozenset({"_data", "_result"})


def _unstored_private(event: BaseModel, back: BaseModel) -> tuple[str, str] | None:
    """The first private attribute of `event` (a pydantic `PrivateAttr`) whose value
    `back`, its decoded copy, does not hold: the serializer drops private attributes,
    so a decoded copy has the attribute's default instead."""
    kept = getattr(back, "__pydantic_private__", None) or {}
    for name, value in (getattr(event, "__pydantic_private__", None) or {}).items():
        if name in _STORED_PRIVATE:
            continue
        again = kept.get(name, _MISSING)
        if again is _MISSING or _mismatch(value, again, name) is not None:
            shown = "no value" if again is _MISSING else f"{again!r:.40}"
            return (
                name,
                f"it is a private attribute, which is not stored: it would come back as {shown}",
            )
    return None


def check_event_storable(
    event: BaseModel, serializer: JsonSerializer, outcome: str, *, qualified: bool, **ids: Any
) -> None:
    """Raise `CheckpointInvalid` naming the first field of `event` the store would give
    back as another value (`unstorable_event`); `outcome` says what came of the event,
    and `qualified` names the field with the event's type."""
    found = unstorable_event(event, serializer)
    if found is None:
        return
    field, reason = found
    name = type(event).__name__
    raise CheckpointInvalid(
        f"{name} value at {field} cannot be stored as it is: {reason} (a recovery would "
        f"continue with that other value); {outcome}: send plain JSON values, or declare "
        "the field's type on the event",
        field=f"{name}.{field}" if qualified else field,
        **ids,
    )


def _as_read_back(state: BaseModel, schema: StateSchema, **ids: Any) -> BaseModel | None:
    """`state` as its model reads it from its plain form (what a checkpoint gives back),
    or None when the model does not accept that form (or is not a typed model)."""
    if isinstance(state, DictState) or schema.strict:
        return None
    model = type(state)
    try:
        back = model.model_validate(state.model_dump(round_trip=True, warnings=False), by_name=True)
    except (ValidationError, ValueError, TypeError):
        return None
    validated = schema.validate(back, **ids)
    return validated if isinstance(validated, model) else None


def _retyped(value: Any, back: Any, path: str) -> tuple[str, str] | None:
    """Where a model in `value` reads back (`back`) as another type: a model of a union
    with no discriminator read as another member, a subclass read as the base class its
    field declares (its own fields dropped), a model in an `Any` field read as a dict.
    Plain data read as a model (a dict, an ISO string) is the model's own reading."""
    if isinstance(value, (BaseModel, Enum)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    ):
        if type(back) is not type(value) and not (isinstance(value, Enum) and back == value):
            return path, f"a {type(value).__name__} would come back as a {type(back).__name__}"
        if not isinstance(value, BaseModel):
            return None
        for name in type(value).model_fields:
            found = _retyped(getattr(value, name), getattr(back, name, None), _path(path, name))
            if found is not None:
                return found
        return None
    if isinstance(value, dict) and isinstance(back, dict):
        for key in value:
            if key in back:
                found = _retyped(value[key], back[key], _path(path, key))
                if found is not None:
                    return found
        return None
    if isinstance(value, (list, tuple)) and isinstance(back, (list, tuple)):
        for i, (a, b) in enumerate(zip(value, back, strict=False)):
            found = _retyped(a, b, _path(path, i))
            if found is not None:
                return found
    return None


def checked_state(
    state: BaseModel, schema: StateSchema | None, serializer: JsonSerializer, **ids: Any
) -> BaseModel:
    """`state` validated against `schema` (`CheckpointInvalid` naming the field) and
    storable as it is (`check_storable`). A typed field given a value its model accepts
    in another form ({"n": "5"} for an int, a dict for a nested model, an ISO string
    for a datetime) is taken as the model reads it, which is what the checkpoint gives
    back, so the live state and every later read hold the same value. A model that
    would be read back as another type (`_retyped`) is refused naming its field: taking
    the other type would silently change what the step wrote. A value nested too deeply
    for the serializer is refused naming its key, not with a bare `RecursionError`."""
    try:
        return _checked_state(state, schema, serializer, **ids)
    except RecursionError as exc:
        key = _too_deep_key(state, serializer)
        raise CheckpointInvalid(
            f"state value at {key} cannot be stored: {_TOO_DEEP}; nothing was stored",
            field=key,
            **ids,
        ) from exc


def _too_deep_key(state: BaseModel, serializer: JsonSerializer) -> str:
    """The first key (or field) of `state` whose value the serializer cannot encode for
    its depth ("<root>" if none on its own)."""
    if isinstance(state, DictState):
        entries = list(state.items())
    else:
        entries = [(name, getattr(state, name)) for name in type(state).model_fields]
    return next((str(key) for key, value in entries if _is_too_deep(value, serializer)), "<root>")


def _checked_state(
    state: BaseModel, schema: StateSchema | None, serializer: JsonSerializer, **ids: Any
) -> BaseModel:
    if schema is not None:
        state = schema.validate(state, **ids)
        back = _as_read_back(state, schema, **ids)
        changed = back is not None and any(
            _mismatch(getattr(state, name), getattr(back, name), name) is not None
            for name in type(state).model_fields
        )
        if back is not None and changed:
            for name in type(state).model_fields:
                found = _retyped(getattr(state, name), getattr(back, name), name)
                if found is not None:
                    field, reason = found
                    raise CheckpointInvalid(
                        f"state value at {field} cannot be stored as it is: {reason} (its "
                        "field's model reads the stored data as that type); nothing was "
                        "stored: give the models a Literal field to discriminate them, or "
                        "declare the exact type",
                        field=field,
                        **ids,
                    )
        if back is not None and changed and unstorable(back, serializer) is None:
            return back
    check_storable(state, serializer, **ids)
    return state


def set_path(state: BaseModel, path: str, value: Any, outcome: str, **ids: Any) -> BaseModel:
    """`state` with `value` set at `path` (the framework's `set_by_path_copy`, which
    leaves `state` as it is), or `CheckpointInvalid` naming `path` when the model has no
    field there or refuses the value on assignment (`validate_assignment`). The
    framework would raise its own `ValueError` (or the model's `ValidationError`), unlike
    every other refused state write; `outcome` says what came of the write."""
    try:
        return set_by_path_copy(state, path, value)
    except ValidationError as exc:  # a model that validates assignments
        raise CheckpointInvalid(
            f"state does not satisfy its schema at {path}: {exc.errors()[0].get('msg')}; {outcome}",
            field=path,
            **ids,
        ) from exc
    except (ValueError, TypeError, AttributeError, LookupError) as exc:
        raise CheckpointInvalid(
            f"{type(state).__name__} has no field {path!r} ({exc}); {outcome}",
            field=path,
            **ids,
        ) from exc


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
