"""A LangGraph state schema as the core's `StateSchema`, checked key by key (P4).

LangGraph stores state as one channel per key and a checkpoint may hold only
some of them (keys not yet written), so the check is partial: each present
key must satisfy its declared type, with its constraints (`Annotated[int,
Ge(0)]`, `Field(ge=0)`). Reducer metadata in `Annotated` (e.g.
`operator.add`) is ignored by validation. The field types are gathered from a
TypedDict, a Pydantic model or a dataclass into a `total=False` TypedDict,
which the core validates and which names the failing field. A Pydantic
model's or dataclass's own checks (validators, `__post_init__`, a config of
its own) hold of a whole state: they are run on every checkpoint that has the
keys the type requires, and on the state a task's writes would make. A type
with none has nothing more to check of a whole state than of its keys.

A node's write is checked before it is stored, so that a refused write never
becomes a pending write that every later read of the thread re-applies: a
plain key's write is its new value; a reducer key's writes are checked as the
reducer makes them of the key's empty value, against the key's type without
its outer constraints (those hold of the whole value, not of one write).
Where the key has such constraints (`Annotated[int, Ge(0), operator.add]`), the
value the key would hold once the write is applied to its current value (and
to the writes of the step's other finished tasks) is checked against them too:
stored, a write that takes the key out of its bounds would make every later
checkpoint of the thread invalid, and the thread could not go on.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any

from langgraph._internal._typing import MISSING
from langgraph.channels.binop import BinaryOperatorAggregate
from langgraph.channels.last_value import LastValue, LastValueAfterFinish
from langgraph.graph.message import add_messages
from langgraph.types import Overwrite
from pydantic import (
    BaseModel,
    PlainValidator,
    PydanticSchemaGenerationError,
    TypeAdapter,
    ValidationError,
)
from pydantic.fields import FieldInfo
from pydantic.v1 import BaseModel as V1Model
from pydantic.v1 import validate_model as v1_validate_model
from pydantic_core import PydanticSerializationError
from typing_extensions import TypedDict, is_typeddict

from remit_core.errors import CheckpointInvalid
from remit_core.schema import StateSchema

try:  # (`DeltaChannel` is newer than some LangGraph releases this package supports)
    from langgraph.channels.delta import DeltaChannel
    from langgraph.checkpoint.serde.types import _DeltaSnapshot
except ImportError:  # pragma: no cover

    class DeltaChannel:  # type: ignore[no-redef]
        """Stands in for a channel kind this LangGraph does not have."""

    class _DeltaSnapshot:  # type: ignore[no-redef]
        """Stands in for a snapshot kind this LangGraph does not have."""

        value: Any


#: Channel kinds whose every write is a whole new value of the key (so a write can be checked).
_PLAIN_CHANNELS = (LastValue, LastValueAfterFinish)
#: Channel kinds that fold writes into the key's value with a reducer.
_REDUCER_CHANNELS = (BinaryOperatorAggregate, DeltaChannel)


def _bare(field_type: Any) -> Any:
    """`field_type` without its outer `Annotated` metadata (reducer, constraints)."""
    while typing.get_origin(field_type) is Annotated:
        field_type = typing.get_args(field_type)[0]
    return field_type


def _field_types(state_type: Any) -> dict[str, Any]:
    if isinstance(state_type, type) and issubclass(state_type, BaseModel):
        fields: dict[str, Any] = {}
        for name, f in state_type.model_fields.items():
            args = (f.annotation, *f.metadata)
            fields[name] = Annotated[args] if f.metadata else f.annotation
        return fields
    if (
        dataclasses.is_dataclass(state_type)
        or typing.is_typeddict(state_type)
        or hasattr(state_type, "__annotations__")
    ):
        return typing.get_type_hints(state_type, include_extras=True)
    raise TypeError(f"cannot read state fields from {state_type!r}")


def _required_fields(state_type: type) -> set[str]:
    """The fields of a model or dataclass that have no default."""
    if issubclass(state_type, BaseModel):
        return {name for name, f in state_type.model_fields.items() if f.is_required()}
    return {
        f.name
        for f in dataclasses.fields(typing.cast(Any, state_type))
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }


def _has_own_checks(state_type: type) -> bool:
    """Whether a model or dataclass checks more of a state than its fields' types
    and constraints (which the key-by-key check applies): validators, a
    post-init, a config of its own, a discriminated field, a Pydantic dataclass
    (whose `Field(...)` defaults hold constraints). Only such a type has a whole
    state checked: each checkpoint, and each node's output (a slower path)."""
    decorators = getattr(state_type, "__pydantic_decorators__", None)
    if decorators is not None and (
        decorators.validators
        or decorators.field_validators
        or decorators.root_validators
        or decorators.model_validators
    ):
        return True
    if issubclass(state_type, BaseModel):
        return (
            bool(state_type.model_config)
            or state_type.model_post_init is not BaseModel.model_post_init
            or any(f.discriminator is not None for f in state_type.model_fields.values())
        )
    if not dataclasses.is_dataclass(state_type):
        return False
    return (
        hasattr(state_type, "__pydantic_fields__")
        or hasattr(state_type, "__post_init__")
        or any(isinstance(f.default, FieldInfo) for f in dataclasses.fields(state_type))
    )


def plain_record_types(types: Any) -> set[type]:
    """The NamedTuple classes and `numpy.ndarray` that `types` name, at any depth.
    LangGraph's own allowlist of a schema's types leaves them out; both store and
    rebuild without running code (a tuple by position, an array from its buffer)."""
    found: set[type] = set()
    seen: set[int] = set()
    todo = list(types)
    while todo:
        typ = todo.pop()
        if id(typ) in seen or typ is None:
            continue
        seen.add(id(typ))
        todo.extend(typing.get_args(typ))
        if not isinstance(typ, type):
            continue
        if (issubclass(typ, tuple) and hasattr(typ, "_fields")) or (
            typ.__module__,
            typ.__name__,
        ) == ("numpy", "ndarray"):
            found.add(typ)
        if issubclass(typ, tuple) or dataclasses.is_dataclass(typ) or is_typeddict(typ):
            with contextlib.suppress(Exception):  # (an unresolvable hint names nothing)
                todo.extend(typing.get_type_hints(typ).values())
        elif issubclass(typ, BaseModel):
            todo.extend(f.annotation for f in typ.model_fields.values())
    return found


def _checkable(field_type: Any) -> Any:
    """`field_type`, or `Any` where Pydantic cannot check it (e.g. `numpy.ndarray`):
    such a key is still stored through the serializer's allowlist, unchecked. A
    `pydantic.v1` model in it is checked by its own validation (`_v1_checked`)."""
    field_type = _v1_checked(field_type)
    try:
        TypeAdapter(field_type)
    except PydanticSchemaGenerationError:
        return Any
    return field_type


def _v1_checked(field_type: Any) -> Any:
    """`field_type` with each `pydantic.v1` model in it checked as such: an instance of
    it whose fields pass its validation. Pydantic 2 builds a schema of a v1 model
    but calls its validator with arguments it does not take, refusing every value."""
    if isinstance(field_type, type) and issubclass(field_type, V1Model):
        return Annotated[Any, PlainValidator(functools.partial(_v1_valid, field_type))]
    args = typing.get_args(field_type)
    if not args:
        return field_type
    if typing.get_origin(field_type) is Annotated:
        inner = _v1_checked(args[0])
        annotated = (inner, *field_type.__metadata__)
        return field_type if inner is args[0] else Annotated[annotated]
    new = tuple(_v1_checked(a) for a in args)
    if all(a is b for a, b in zip(new, args, strict=True)):
        return field_type
    if isinstance(field_type, types.GenericAlias):  # list[M], dict[str, M]
        return types.GenericAlias(typing.get_origin(field_type), new)
    if isinstance(field_type, types.UnionType):  # M | None
        return typing.Union[new]  # noqa: UP007 (built from a tuple of types)
    return field_type.copy_with(new)  # typing's generics: Optional[M], List[M]


def _v1_valid(model: type[V1Model], value: Any) -> Any:
    if not isinstance(value, model):
        raise ValueError(f"expected an instance of {model.__qualname__}")
    *_, error = v1_validate_model(model, value.dict(by_alias=True))
    if error is not None:
        raise ValueError(
            "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        )
    return value


class StateCheck:
    """Validates checkpoint values and node writes against a graph's state type."""

    def __init__(self, fields: Mapping[str, Any], declared: StateSchema | None = None) -> None:
        self.declared = declared
        self.version = declared.version if declared is not None else 1
        self.fields = frozenset(fields)
        #: The keys the state type itself declares, which its own checks hold of.
        self._own = self.fields
        self._partial = StateSchema(
            TypedDict("PartialState", dict(fields), total=False),  # type: ignore[operator]
            version=self.version,
        )
        self._types = dict(fields)
        self._plain: frozenset[str] = frozenset()
        #: key -> (its channel, an adapter of its type without outer constraints)
        self._reducers: dict[str, tuple[Any, TypeAdapter[Any]]] = {}
        self._reduced: StateSchema | None = None  # the same, named like the state's
        self._plain_reducers: frozenset[str] = frozenset()
        #: Reducer keys that concatenate lists (`Annotated[list[T], operator.add]`):
        #: a list write that holds as it stands makes a value that holds.
        self._appends: dict[str, TypeAdapter[Any]] = {}
        #: Reducer key -> a test that a value is of its type as it stands (strict
        #: validation passes it, so lax validation would convert nothing in it).
        self._strict: dict[str, Callable[[Any], bool]] = {}
        #: Reducer keys whose type bounds the whole value (`Ge(0)`, `MaxLen(3)`): a
        #: write is checked by the value it makes of the key's current one (`totals`).
        self._bounded: frozenset[str] = frozenset()
        #: key -> a test that a write to it holds as it stands (`holds`).
        self._quick: dict[str, Callable[[Any], bool]] = {}
        self._channels: Mapping[str, Any] | None = None
        #: A model's (or dataclass's) own checks (validators, `__post_init__`) hold of
        #: a whole state: the state type, and the keys a whole state has.
        self._whole: StateSchema | None = None
        self._required: frozenset[str] = frozenset()
        #: List keys of models (a chat's messages), checked item by item (`_Items`).
        self._items = {
            k: _Items(item) for k, t in self._types.items() if (item := _model_items(t)) is not None
        }

    @classmethod
    def of(cls, state: Any, others: Iterable[Any] = ()) -> StateCheck | None:
        """From a state type or a `StateSchema`; None for a JSON Schema dict or no fields.
        `others`: the graph's other schemas (its input and output schemas, the input
        types of its nodes), whose keys the state type lacks are state channels too
        (private state): each is checked by the type the first of them declares."""
        declared = state if isinstance(state, StateSchema) else None
        state_type = declared.type_ if declared is not None else state
        if isinstance(state_type, Mapping):
            return None
        try:
            fields = _field_types(state_type)
        except TypeError:
            return None
        own = frozenset(fields)
        for other in others:
            try:
                more = _field_types(other)
            except (TypeError, NameError):  # (no fields, or hints that do not resolve)
                continue
            fields = {**more, **fields}
        if not fields:
            return None
        check = cls({k: _checkable(t) for k, t in fields.items()}, declared)
        check._own = own
        if isinstance(state_type, type) and _has_own_checks(state_type):
            check._whole = StateSchema(state_type, version=check.version)
            check._required = frozenset(_required_fields(state_type))
        return check

    def with_channels(self, channels: Mapping[str, Any]) -> StateCheck:
        """Note which keys are plain channels, whose writes are checked one by one."""
        if channels is self._channels:
            return self  # every run of a graph passes its graph's channels
        self._plain = frozenset(
            k for k, ch in channels.items() if k in self.fields and isinstance(ch, _PLAIN_CHANNELS)
        )
        bare = {
            k: _bare(self._types[k])
            for k, ch in channels.items()
            if k in self.fields and isinstance(ch, _REDUCER_CHANNELS)
        }
        self._reducers = {k: (channels[k], TypeAdapter(t)) for k, t in bare.items()}
        #: Reducer keys of plain data, which strict validation checks as they stand.
        self._plain_reducers = frozenset(k for k, t in bare.items() if StateSchema(t).plain)
        self._appends = {
            k: adapter for k, (ch, adapter) in self._reducers.items() if _appends_lists(ch, bare[k])
        }
        self._bounded = frozenset(
            k
            for k, (ch, _) in self._reducers.items()
            if isinstance(ch, BinaryOperatorAggregate) and _bounds_value(self._types[k])
        )
        strict = {k: _strict_validator(adapter) for k, (_, adapter) in self._reducers.items()}
        self._strict = {k: test for k, test in strict.items() if test is not None}
        self._reduced = (
            StateSchema(TypedDict("ReducedWrites", bare, total=False))  # type: ignore[operator]
            if bare
            else None
        )
        # (A key's type is one Pydantic takes, `_checkable`: its adapter builds.)
        # A key of models gets a quick test only where its items are checked deeply
        # (`_Items`): an instance built or changed without validation passes strict
        # validation as it stands.
        types, items = self._types, self._items
        quick = {
            k: _strict_test(TypeAdapter(types[k]), types[k])
            for k in self._plain
            if StateSchema(types[k]).plain
        }
        quick.update(
            {
                k: _deep(_strict_test(a, bare[k], lists=True), items.get(k))
                for k, a in self._appends.items()
                if k in self._plain_reducers or k in items
            }
        )
        quick.update(
            {
                k: _deep(_messages_test(a), items[k])
                for k, (ch, a) in self._reducers.items()
                if _adds_messages(ch) and k in items
            }
        )
        # (A bounded key's write is checked against the key's value: no quick test.)
        self._quick = {
            k: test for k, test in quick.items() if test is not None and k not in self._bounded
        }
        self._channels = channels
        return self

    def values(self, values: Mapping[str, Any], keys: Any = None, **ids: Any) -> None:
        """Check the state keys among `values` (only `keys` when given); `CheckpointInvalid`."""
        chosen = self.fields if keys is None else self.fields & set(keys)
        present = {k: _unwrapped(values[k]) for k in chosen if k in values}
        if present:
            rest = present
            if self._items:
                rest = {}
                for k, v in present.items():
                    items = self._items.get(k)
                    if items is not None and type(v) is list:
                        items.check(k, v, ids)
                    else:
                        rest[k] = v
            if rest and not self._partial.holds_as_is(rest):
                _as_declared(rest, self._partial.validate(rest, **ids), ids)
            self._check_whole({k: _unwrapped(values[k]) for k in self._own if k in values}, ids)

    @property
    def checks_whole(self) -> bool:
        """Whether `after` checks anything: the state type has checks of its own."""
        return self._whole is not None

    def after(self, channels: Mapping[str, Any] | None, writes: Any, **ids: Any) -> None:
        """Check the whole state `channels` hold once a task's `writes` are applied,
        for a state type with checks of its own (a model's validators): a write
        valid key by key can still break them."""
        if self._whole is None or channels is None:
            return
        state: dict[str, Any] = {}
        for key in self._own:
            channel = channels.get(key)
            with contextlib.suppress(Exception):  # (an empty channel has no value)
                state[key] = channel.get() if channel is not None else MISSING
        state = {k: v for k, v in state.items() if v is not MISSING}
        grouped: dict[str, list[Any]] = {}
        for key, value in writes:
            if key in self._own:
                grouped.setdefault(key, []).append(value)
        for key, values in grouped.items():
            channel = channels.get(key)
            if key in self._plain or channel is None:
                state[key] = values[-1]
                continue
            try:
                applied = channel.copy()
                applied.update(values)
                state[key] = applied.get()
            except Exception:  # noqa: BLE001 (the key-by-key check reports a bad write)
                continue
        self._check_whole(state, ids)

    def bounds_any(self, writes: Iterable[tuple[str, Any]]) -> bool:
        """Whether any of `writes` is to a reducer key whose type bounds its value."""
        return bool(self._bounded) and any(key in self._bounded for key, _ in writes)

    def totals(
        self,
        channels: Mapping[str, Any] | None,
        writes: Iterable[tuple[str, Any]],
        earlier: Iterable[tuple[str, Any]] = (),
        **ids: Any,
    ) -> None:
        """`CheckpointInvalid` where `writes`, applied after `earlier` (the writes of
        the step's other finished tasks) to the values `channels` hold, would take a
        reducer key out of its type's bounds (`Annotated[int, Ge(0), operator.add]`
        and a write that subtracts more than the key holds)."""
        if not self._bounded or channels is None:
            return
        grouped: dict[str, list[Any]] = {}
        for key, value in writes:
            if key in self._bounded:
                grouped.setdefault(key, []).append(value)
        if not grouped:
            return
        before: dict[str, list[Any]] = {}
        for key, value in earlier:
            if key in grouped:
                before.setdefault(key, []).append(value)
        for key, values in grouped.items():
            channel = channels.get(key)
            if channel is None:
                continue
            try:
                # On a copy of the value: a reducer may change its first argument in place.
                applied = (
                    channel.from_checkpoint(copy.deepcopy(channel.get()))
                    if channel.is_available()
                    else channel.copy()
                )
                applied.update([*before.get(key, ()), *values])
                total = applied.get()
            except Exception:  # noqa: BLE001 (no value yet, or two `Overwrite`s: LangGraph says)
                continue
            try:
                self._partial.validate({key: total}, **ids)
            except CheckpointInvalid as exc:
                raise CheckpointInvalid(
                    f"the write to {key!r} would make its value {total!r}, which breaks its "
                    f"type ({exc.message}); nothing of it was stored",
                    field=exc.field,
                    **ids,
                ) from exc

    def totals_on(
        self,
        values: Mapping[str, Any],
        writes: Iterable[tuple[str, Any]],
        earlier: Iterable[tuple[str, Any]] = (),
        **ids: Any,
    ) -> None:
        """`totals` on a checkpoint's `values` (a command's update, or input, before it is
        stored); a key the checkpoint has no value for starts as the key's empty value."""
        if not self._bounded:
            return
        channels = {
            k: self._reducers[k][0].from_checkpoint(values.get(k, MISSING)) for k in self._bounded
        }
        self.totals(channels, writes, earlier, **ids)

    def fits_on(
        self,
        values: Mapping[str, Any],
        writes: Iterable[tuple[str, Any]],
        earlier: Iterable[tuple[str, Any]] = (),
        **ids: Any,
    ) -> None:
        """`_fits` on a checkpoint's `values` after its `earlier` updates: a command's
        update or new input whose reducer needs the key's value to refuse it (the
        removal of a message the chat lacks), refused before its resume value is
        consumed or its input checkpoint stored. Stored, LangGraph would apply it
        again on every later run of the thread, and fail each time."""
        grouped: dict[str, list[Any]] = {}
        for key, value in writes:
            if key in self._reducers:
                grouped.setdefault(key, []).append(value)
        for key, pending in grouped.items():
            template = self._reducers[key][0]
            try:
                # A write the empty value takes (an append) is taken whatever the key
                # holds: only one it refuses (a removal) needs the copy below.
                template.from_checkpoint(MISSING).update(pending)
                continue
            except Exception:  # noqa: BLE001, S110 (the key's value may take it: below)
                pass
            # On a copy of the value: a reducer may change its first argument in place.
            channel = template.from_checkpoint(copy.deepcopy(values.get(key, MISSING)))
            for at, value in earlier:
                if at == key:
                    with contextlib.suppress(Exception):  # (refused when it was made)
                        channel.update([value])
            self._fits(key, pending, {key: channel}, **ids)

    def _check_whole(self, state: Mapping[str, Any], ids: Mapping[str, Any]) -> None:
        """`state` checked as a whole by the state type, once it has every key the
        type requires (before that, as in an input checkpoint, it is not a state)."""
        if self._whole is not None and self._required <= state.keys():
            self._whole.validate(dict(state), **ids)

    def holds(self, writes: Iterable[tuple[str, Any]]) -> bool:
        """Whether every write to a state key passes its key's quick test
        (`quick_tests`): then `writes` would find nothing wrong. False says nothing."""
        quick, fields = self._quick, self.fields
        for ch, v in writes:
            test = quick.get(ch)
            if test is None:
                if ch in fields:
                    return False
            elif not test(v):
                return False
        return True

    def loaded(self, values: Mapping[str, Any], noted: Mapping[int, tuple[Any, Any]]) -> None:
        """Note the items of list keys of models (a chat's messages) among `values`, a
        checkpoint's values just rebuilt: `noted` holds the models the serializer
        validated as it rebuilt them, with the fields it rebuilt them from
        (`StrictSerializer.noting`). See `_Items.trust`."""
        for key, items in self._items.items():
            value = values.get(key)
            if type(value) is list:
                items.trust(value, noted)

    def quick_tests(self) -> tuple[Mapping[str, Callable[[Any], bool]], frozenset[str]]:
        """The cheap way to say a node's writes hold as they stand, key by key: a
        test per key (a write to a plain key is of its type, a list appended to a
        list key is of the list's type; strict validation, so nothing in it would
        be converted), and the state keys, which a write to a key with no test
        sends to the full check (`writes`). A test's False says nothing: `writes`
        says what is wrong, if anything. Taken once per run, as of its channels."""
        return self._quick, self.fields

    def writes(self, writes: Any, channels: Mapping[str, Any] | None = None, **ids: Any) -> None:
        """Check a task's writes to state channels (see the module docstring);
        `channels`: the graph's channels as the task's step found them, if known."""
        present: dict[str, Any] = {}
        reduced: dict[str, list[Any]] = {}
        appends = self._appends
        for ch, v in writes:
            if ch in self._plain:
                present[ch] = v
            elif (
                ch in appends
                and type(v) is list
                and self._holds_as_is(ch, v)
                and (ch in self._plain_reducers or (ch in self._items and self._items[ch].holds(v)))
            ):
                continue  # (the empty list plus `v` is `v`; a key's lists join alike)
            elif ch in self._reducers:
                reduced.setdefault(ch, []).append(v)
        if present and not self._partial.holds_as_is(present):
            _as_declared(present, self._partial.validate(present, **ids), ids)
        for ch, values in reduced.items():
            value = self._reduce(ch, values, channels, **ids)
            if value is MISSING:
                continue
            items = self._items.get(ch)
            if items is not None and type(value) is list:
                items.check(ch, value, ids)  # (each item deeply, as `StateSchema.validate`)
                continue
            if ch in self._plain_reducers and self._holds_as_is(ch, value):
                continue
            assert self._reduced is not None
            # Raises naming the field; a model in the value is checked by its plain form too.
            _as_declared({ch: value}, self._reduced.validate({ch: value}, **ids), ids)

    def _holds_as_is(self, key: str, value: Any) -> bool:
        """Whether `value` is of reducer key `key`'s type as it stands (False says nothing)."""
        test = self._strict.get(key)
        return test is not None and test(value)

    def _reduce(
        self, channel: str, values: list[Any], channels: Mapping[str, Any] | None, **ids: Any
    ) -> Any:
        """What the reducer of `channel` makes of its empty value and `values`; MISSING
        where that says nothing (no empty value, or the reducer needs the real one:
        then, where `channels` has it, `values` must fit the key's value there)."""
        template = self._reducers[channel][0]
        delta = isinstance(template, DeltaChannel)  # (it starts from its type's empty value)
        empty = template.value
        if empty is MISSING and not delta:
            return MISSING  # the first write would stand for the whole value
        try:
            # (A dict may spell an `Overwrite`: the channel's own update reads it.)
            if not delta and not any(isinstance(v, (Overwrite, dict)) for v in values):
                value = type(empty)()
                for v in values:
                    value = template.operator(value, v)
                return value
            fresh = template.from_checkpoint(MISSING)
            fresh.update(values)
            return fresh.value
        except TypeError as exc:  # e.g. a string added to a list
            raise CheckpointInvalid(
                f"the write to {channel!r} does not fit its reducer: {exc}", field=channel, **ids
            ) from exc
        except Exception:  # noqa: BLE001 (e.g. removing a message the empty value lacks)
            self._fits(channel, values, channels, **ids)
            return MISSING

    @staticmethod
    def _fits(
        channel: str, values: list[Any], channels: Mapping[str, Any] | None, **ids: Any
    ) -> None:
        """`CheckpointInvalid` where the reducer of `channel` refuses `values` on the
        key's value in `channels` (a message of no kind, the removal of one the key
        lacks): stored, such a write would fail every later run of the thread, as
        LangGraph applies it again."""
        current = None if channels is None else channels.get(channel)
        if current is None:
            return
        try:
            current.copy().update(values)
        except Exception as exc:  # noqa: BLE001 (the reducer's own error, whatever its class)
            raise CheckpointInvalid(
                f"the write to {channel!r} does not fit its reducer: {exc}", field=channel, **ids
            ) from exc

    def upgrade(self, values: dict[str, Any], written_version: int, **ids: Any) -> dict[str, Any]:
        """Migrate a state written with an older schema version (or refuse, `VersionMismatch`).

        The migration is handed the state as it was written: every key of the old
        version, those this version no longer declares included (a migration that
        renames `amount` to `total` reads `amount`); LangGraph's own channels (the
        `__start__`, `branch:to:` and `join:` ones) pass through untouched. A key
        the migration drops is gone from the values it returns."""
        if written_version == self.version or self.declared is None:
            return values
        state = {k: v for k, v in values.items() if not is_graph_channel(k)}
        upgraded = self.declared.upgrade(state, written_version, **ids)
        return {**{k: v for k, v in values.items() if is_graph_channel(k)}, **upgraded}


def is_graph_channel(key: str) -> bool:
    """Whether `key` names one of LangGraph's own channels (`__start__`, `__pregel_tasks`,
    `branch:to:<node>`, `join:<a>+<b>:<node>`), not a state key."""
    return key.startswith(("__", "branch:to:", "join:"))


_SCALARS = (bool, int, float, str, bytes)


def _as_declared(given: Any, validated: Any, ids: Mapping[str, Any], path: str = "") -> None:
    """`CheckpointInvalid` where validation passed `given` only by converting a plain
    value to another type ("5" to 5, 1 to True): LangGraph stores what the node
    returned, not the converted value, so the stored state would not be of its
    declared type. (An int where a float is declared is a float's value.) `path`:
    where `given` is in the state, if it is not the state."""
    where = _converted(given, validated, path)
    if where is not None:
        path, value, kept = where
        raise CheckpointInvalid(
            f"state value at {path} is a {type(value).__name__} ({value!r:.40}); the schema "
            f"declares {type(kept).__name__}, and the value would be stored unconverted",
            field=path,
            **ids,
        )


def _bounds_value(field_type: Any) -> bool:
    """Whether `field_type`'s outer `Annotated` metadata holds more than its reducer:
    a constraint (`Ge(0)`, `Field(ge=0)`, `MaxLen(3)`) of the key's whole value."""
    while typing.get_origin(field_type) is Annotated:
        if any(not callable(m) for m in field_type.__metadata__):
            return True
        field_type = typing.get_args(field_type)[0]
    return False


def _appends_lists(channel: Any, bare_type: Any) -> bool:
    """Whether `channel` folds writes into its key with `operator.add` from an empty
    list, for a key of type `list[T]`: the value then holds if each write does
    (strict validation of a list is element by element)."""
    return (
        type(channel) is BinaryOperatorAggregate
        and channel.operator is operator.add
        and type(channel.value) is list
        and typing.get_origin(bare_type) is list
    )


#: Types whose every value of exactly that type passes strict validation.
_EXACT = (str, int, float, bool, bytes)


def _strict_test(
    adapter: TypeAdapter[Any], type_: Any, *, lists: bool = False
) -> Callable[[Any], bool] | None:
    """A test that a value is of `type_` (`adapter`'s) as it stands (a list of it, if
    `lists`), without raising; None where Pydantic's validator cannot give one. A
    value of exactly a plain type (`str`, `int`, ...), or a list of such values,
    passes at once; Pydantic's strict validator tests the rest."""
    strict = _strict_validator(adapter)
    if strict is None:
        return None
    if lists:
        args = typing.get_args(type_)
        item = args[0] if len(args) == 1 and args[0] in _EXACT else None
        if item is None:
            return lambda v: type(v) is list and strict(v)

        def test(v: Any) -> bool:
            if type(v) is not list:
                return False
            for x in v:
                if type(x) is not item:
                    return strict(v)
            return True

        return test
    if type_ in _EXACT:
        return lambda v: type(v) is type_ or strict(v)
    return strict


def _strict_validator(adapter: TypeAdapter[Any]) -> Callable[[Any], bool] | None:
    """Whether a value passes `adapter` in strict mode, as a test that never raises
    (a callable discriminator may raise `TypeError` on a value of no kind it knows);
    None where Pydantic's validator cannot give one."""
    try:
        isinstance_python = adapter.validator.isinstance_python
    except Exception:  # noqa: BLE001 (e.g. an unresolved forward reference: the full check)
        return None

    def strict(v: Any) -> bool:
        try:
            return bool(isinstance_python(v, strict=True))
        except Exception:  # noqa: BLE001 (says nothing: the full check tells)
            return False

    return strict


def _adds_messages(channel: Any) -> bool:
    """Whether `channel` folds writes into its key with LangGraph's `add_messages`
    from an empty list (`MessagesState`, `Annotated[list[AnyMessage], add_messages]`)."""
    return (
        type(channel) is BinaryOperatorAggregate
        and channel.operator is add_messages
        and type(channel.value) is list
    )


def _messages_test(adapter: TypeAdapter[Any]) -> Callable[[Any], bool] | None:
    """A test that a write to an `add_messages` key is messages of the key's type
    (`adapter`'s, a list type) as they stand: a list of them, or one. The reducer
    then makes a list of those very messages (ids given, duplicates merged), which
    holds as they do; a write it would convert (a dict, a tuple, a string) gets the
    full check."""
    strict = _strict_validator(adapter)
    if strict is None:
        return None
    return lambda v: strict(v if type(v) is list else [v])


def _deep(test: Callable[[Any], bool] | None, items: _Items | None) -> Callable[[Any], bool] | None:
    """`test`, then (for a key of models) each item checked deeply by `items`."""
    if test is None or items is None:
        return test
    holds = items.holds
    return lambda v: test(v) and holds(v if type(v) is list else [v])


def _model_items(field_type: Any) -> Any:
    """T, where `field_type` is `list[T]` (annotated with reducers alone, no constraint
    on the list) and T holds models (as `AnyMessage` does); else None."""
    while typing.get_origin(field_type) is Annotated:
        field_type, *metadata = typing.get_args(field_type)
        if not all(callable(m) and not isinstance(m, type) for m in metadata):
            return None  # a constraint on the whole list: checked with the rest
    args = typing.get_args(field_type)
    if typing.get_origin(field_type) is not list or len(args) != 1:
        return None
    return None if StateSchema(args[0]).plain else args[0]


class _Items:
    """The check of a list key's items one by one, as `StateSchema.validate` checks a
    value (the item, then its plain form, which catches an instance built or changed
    without validation), remembering each item that passed with its plain form. A
    checkpoint holds the whole list, a chat's messages grow by a few per step, and
    an item's plain form is several times cheaper to make than to validate: an item
    met again whose plain form is as it was (so is its check, validators being
    functions of it) is not validated again."""

    #: Items remembered (then forgotten at once): each is kept alive while remembered,
    #: so its `id` names no other object.
    KEPT = 4096

    def __init__(self, item_type: Any) -> None:
        self._adapter: TypeAdapter[Any] = TypeAdapter(item_type)
        self._passed: dict[int, tuple[Any, Any, bool]] = {}

    def check(self, key: str, items: list[Any], ids: Mapping[str, Any]) -> None:
        """`CheckpointInvalid` naming the first item of `items` (the list at `key`) that
        fails, and the field in it."""
        for i, item in enumerate(items):
            try:
                validated = self._checked(item)
            except (ValidationError, TypeError) as exc:  # (`TypeError`: see `StateSchema`)
                raise _item_invalid(exc, f"{key}[{i}]", ids) from exc
            if validated is not item:
                _as_declared(item, validated, ids, f"{key}[{i}]")

    def holds(self, items: list[Any]) -> bool:
        """Whether every item of `items` passes as it stands (False says nothing:
        `check` says what is wrong, if anything)."""
        try:
            return all(self._checked(item) is item for item in items)
        except (ValidationError, TypeError):
            return False

    def trust(self, items: list[Any], noted: Mapping[int, tuple[Any, Any]]) -> None:
        """Remember those of `items` that a serializer just rebuilt by validating their
        stored fields (`noted`: see `StateCheck.loaded`), with those fields (or, where
        none were noted, their plain form as it is now): the second pass of `check`
        would repeat that validation. The first (the item against the key's item
        type) is still made at the next check, and an item changed since is checked
        in full."""
        adapter = self._adapter
        for item in items:
            entry = noted.get(id(item))
            if entry is None or entry[0] is not item:
                continue  # (not rebuilt by validation: a dataclass's constructor checks nothing)
            fields = entry[1]
            if fields is None:
                try:
                    fields = adapter.dump_python(
                        item, round_trip=True, by_alias=False, warnings=False
                    )
                except Exception:  # noqa: BLE001 (not remembered: `check` says what is wrong)
                    continue
            self._remember(item, fields, whole=False)

    def _checked(self, item: Any) -> Any:
        """`item` validated (raises as Pydantic does), and remembered if it passed."""
        seen = self._passed.get(id(item))
        if seen is not None and seen[0] is item and _fields(item) == seen[1]:
            # Remembered, and its fields are as they were (a message's are plain data).
            if seen[2]:
                return item  # checked here in full: the check would say the same
            if self._adapter.validate_python(item) is item:  # (its class checked the rest)
                self._remember(item, seen[1], whole=True)
                return item
        adapter = self._adapter
        validated = adapter.validate_python(item)
        try:
            plain = adapter.dump_python(validated, round_trip=True, by_alias=False, warnings=False)
        except PydanticSerializationError:
            return validated  # no plain form: the first pass is all there is
        if validated is not item:  # (a converted item is not what the state holds)
            adapter.validate_python(plain, by_name=True)
            return validated
        if seen is None or seen[0] is not item or seen[1] != plain:
            adapter.validate_python(plain, by_name=True)
        self._remember(item, plain, whole=True)
        return validated

    def _remember(self, item: Any, plain: Any, *, whole: bool) -> None:
        """Remember that `item` had the plain form `plain` when it passed, the check
        against this key's item type included (`whole`) or not (`trust`)."""
        passed = self._passed
        if len(passed) >= self.KEPT:
            passed.clear()
        passed[id(item)] = (item, plain, whole)


def _fields(item: Any) -> Any:
    """An instance's fields as it holds them (a model's or a dataclass's `__dict__`)."""
    return getattr(item, "__dict__", None)


def _item_invalid(
    exc: ValidationError | TypeError, where: str, ids: Mapping[str, Any]
) -> CheckpointInvalid:
    """`CheckpointInvalid` naming the field in item `where` that failed."""
    msg, path = str(exc), where
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        msg = str(first.get("msg"))
        for part in first.get("loc", ()):
            path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return CheckpointInvalid(
        f"state does not satisfy its schema at {path}: {msg}", field=path, **ids
    )


def _converted(given: Any, kept: Any, path: str) -> tuple[str, Any, Any] | None:
    if given is kept:
        return None
    if isinstance(given, _SCALARS) or isinstance(kept, _SCALARS):
        same = (isinstance(kept, type(given)) or isinstance(given, type(kept))) and (
            isinstance(given, bool) == isinstance(kept, bool)
        )
        widened = type(given) is int and type(kept) is float
        equal = given == kept or given != given  # (NaN is itself)
        return None if (same or widened) and equal else (path or "<state>", given, kept)
    steps: Any = ()
    if isinstance(given, Mapping) and isinstance(kept, Mapping):
        steps = ((k, v, kept[k]) for k, v in given.items() if k in kept)
    elif isinstance(given, (list, tuple)) and isinstance(kept, (list, tuple)):
        steps = ((i, a, b) for i, (a, b) in enumerate(zip(given, kept, strict=False)))
    for step, a, b in steps:
        found = _converted(a, b, f"{path}.{step}" if path else str(step))
        if found is not None:
            return found
    return None


def _unwrapped(value: Any) -> Any:
    """A `DeltaChannel` snapshot's value (the key's whole value at that checkpoint)."""
    return value.value if isinstance(value, _DeltaSnapshot) else value
