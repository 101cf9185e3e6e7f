"""LangGraph's serializer protocol, fail-closed: no pickle, a strict type allowlist.

Values are encoded as LangGraph's own `JsonPlusSerializer` encodes them
(msgpack with extension types), so a checkpoint reads the same as LangGraph's
savers would write it (but for a datetime with `fold=1`, which LangGraph's form
would read back an hour early: it keeps its fold, in a form LangGraph's savers read
too). The differences are the ones that matter for safety:

- write time: every object that is not plain data must have its type in the
  allowlist, else `CheckpointInvalid` names the type and where it sits in the
  value. Nothing that could not be read back is ever stored.
- read time: no pickle, no legacy JSON constructors; an extension type that is
  not allowed, or that fails to rebuild, raises `CorruptRecord` instead of
  coming back as `None` or a raw dict.

The allowlist starts from LangGraph's safe types, LangChain's message types and
LangGraph's own records (`Send`, `Interrupt`, `Overwrite`); a graph's state
schema adds its types when the saver meets the graph, and `with_allowlist`
adds more.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as dt
import enum
import functools
import importlib
import sys
import threading
import types
from collections import deque
from collections.abc import Collection, Iterable, Iterator
from typing import Any
from zoneinfo import ZoneInfo

import ormsgpack
from langgraph._internal._serde import curated_core_allowlist
from langgraph.checkpoint.serde import jsonplus
from langgraph.checkpoint.serde._msgpack import SAFE_MSGPACK_METHODS, SAFE_MSGPACK_TYPES
from langgraph.checkpoint.serde.base import SerializerProtocol
from pydantic import BaseModel, RootModel

from remit_core.errors import CheckpointInvalid, CorruptRecord

#: LangGraph records that a run itself stores (task packets, interrupts, overwrites,
#: snapshots).
_LANGGRAPH_TYPES = frozenset(
    {
        ("langgraph.types", "Send"),
        ("langgraph.types", "Interrupt"),
        ("langgraph.types", "Overwrite"),
        # A `DeltaChannel`'s snapshot: its value is checked as any other.
        ("langgraph.checkpoint.serde.types", "_DeltaSnapshot"),
    }
)
_PLAIN = (str, int, float, bool, type(None), bytes, bytearray)
_PLAIN_TYPES = frozenset(_PLAIN)
#: The ext hook's refusal, kept per thread because msgpack re-raises it without a cause.
_refusals = threading.local()
#: Where this thread notes the models it rebuilds, within `StrictSerializer.noting`.
_noted = threading.local()
_CONTAINERS = (list, tuple, set, frozenset)
#: Containers that hold nothing to refuse when empty (a message's `additional_kwargs`).
_EMPTY_FINE = frozenset((dict, *_CONTAINERS))
_OPTIONS = ormsgpack.OPT_NON_STR_KEYS


#: Types of values a walk need not enter: plain data, and (when empty) containers.
_SHALLOW_TYPES = _PLAIN_TYPES | _EMPTY_FINE


#: LangGraph's msgpack options, but a str with a lone surrogate raises: LangGraph
#: writes each as "?", and such a value would read back as another.
_STRICT_OPTION = jsonplus._option & ~ormsgpack.OPT_REPLACE_SURROGATES


def _encoded(obj: Any) -> bytes:
    """`obj` in LangGraph's msgpack form, except that a datetime with `fold=1` (the
    second of a repeated local hour) keeps it (`_default`), and a lone surrogate is
    refused (`_STRICT_OPTION`)."""
    return ormsgpack.packb(obj, default=_default, option=_STRICT_OPTION)


#: LangGraph's encoder of one extension value, its nested values encoded by
#: `_encoded` (a model's or a dataclass's datetime fields keep their fold too).
_langgraph_default = types.FunctionType(
    jsonplus._msgpack_default.__code__,
    {**vars(jsonplus), "_msgpack_enc": _encoded},
    jsonplus._msgpack_default.__name__,
)


def _kept_zone(zone: Any) -> bool:
    """Whether a datetime with `fold=1` is stored with its zone `zone` as it is: a
    fixed offset, or an IANA zone by its key (LangGraph's own safe types), where the
    fold picks the offset of the zone's repeated hour."""
    return type(zone) is dt.timezone or (type(zone) is ZoneInfo and zone.key is not None)


def _default(obj: Any) -> Any:
    """LangGraph's encoding of `obj`, but for a datetime with `fold=1`: LangGraph
    stores a datetime by its ISO form, which keeps no fold, so a naive datetime of the
    hour clocks go back would read back an hour early. Such a one is stored by its
    fields (as LangGraph stores a time), which LangGraph's readers rebuild too; its
    zone as it is if it is a fixed offset or an IANA zone, else (a zone no reader
    could rebuild) as the fixed offset its ISO form names. A datetime with `fold=0`
    is stored as LangGraph stores it."""
    if isinstance(obj, dt.datetime) and obj.fold:
        zone = obj.tzinfo
        if zone is not None and not _kept_zone(zone):
            zone = dt.datetime.fromisoformat(obj.isoformat()).tzinfo
        fields = {
            "year": obj.year,
            "month": obj.month,
            "day": obj.day,
            "hour": obj.hour,
            "minute": obj.minute,
            "second": obj.second,
            "microsecond": obj.microsecond,
            "tzinfo": zone,
            "fold": 1,
        }
        return ormsgpack.Ext(
            jsonplus.EXT_CONSTRUCTOR_KW_ARGS,
            _encoded((obj.__class__.__module__, obj.__class__.__name__, fields)),
        )
    return _langgraph_default(obj)


def _nothing_inside(values: Collection[Any]) -> bool:
    """Whether each of `values` is plain data or an empty container, told with no
    loop in Python (most fields of a chat message): each one's type is one of those,
    and each one that is not empty is plain. (Only builtin types' truth is taken.)"""
    return _SHALLOW_TYPES.issuperset(map(type, values)) and _PLAIN_TYPES.issuperset(
        map(type, filter(None, values))
    )


class _Kind(enum.Enum):
    """How `StrictSerializer._refused` walks an object of a class."""

    PLAIN = "a subclass of a plain type, or an error (stored as its repr)"
    MODEL = "a Pydantic model: its fields"
    DATACLASS = "a dataclass: its fields"
    SEQUENCE = "a namedtuple or a deque: its items"
    OTHER = "anything else"


@functools.lru_cache(maxsize=1024)
def _kind(cls: Any) -> _Kind:
    if issubclass(cls, (*_PLAIN, dict, BaseException)):
        return _Kind.PLAIN
    if issubclass(cls, BaseModel):
        return _Kind.MODEL
    if dataclasses.is_dataclass(cls):
        return _Kind.DATACLASS
    if issubclass(cls, (tuple, deque)):
        return _Kind.SEQUENCE
    return _Kind.OTHER


@functools.lru_cache(maxsize=1024)
def _unreadable(cls: type) -> str | None:
    """Why a value of class `cls` (allowlisted, not plain data) could not be read back
    as it was stored, if so; else None. LangGraph's encoding names the class by its
    module and `__name__`, which a read looks up, and passes the dump's fields to it:
    a class those do not lead to (defined in a function or another class) would read
    back as another class of that name, or not at all; a dataclass field with
    `init=False`, a required model field excluded from its dump, or an enum member
    whose value is a tuple, fails the rebuild."""
    module = sys.modules.get(cls.__module__)
    if module is None or getattr(module, cls.__name__, None) is not cls:
        return (
            f"it is not what {cls.__module__}.{cls.__name__} names (a class defined in a "
            "function or in another class), and a stored value is rebuilt by that name: "
            "define it at module level"
        )
    if dataclasses.is_dataclass(cls):
        hidden = [f.name for f in dataclasses.fields(cls) if not f.init]
        if hidden:
            return (
                f"its fields {hidden} have init=False, and a stored dataclass is rebuilt "
                "by passing every field to its __init__"
            )
    if issubclass(cls, enum.Enum):
        paired = [m.name for m in cls if isinstance(m.value, tuple)]
        if paired:
            return (
                f"its members {paired} have tuple values, which read back as lists, and a "
                "stored member is looked up by its value"
            )
    if issubclass(cls, BaseModel):
        hidden = [n for n, f in cls.model_fields.items() if f.exclude and f.is_required()]
        if hidden:
            return (
                f"its required fields {hidden} are excluded from its dump "
                "(Field(exclude=True)), which a stored model is rebuilt from"
            )
    return None


def _key(item: tuple[str, ...] | type) -> tuple[str, ...]:
    if isinstance(item, type):
        return (item.__module__, item.__name__)
    return tuple(item)


class StrictSerializer(SerializerProtocol):
    """`dumps_typed` / `loads_typed` with a write-time allowlist and no pickle."""

    #: Whether `loads_typed` rebuilds every Pydantic model by validating its stored
    #: fields (a model it returns passed its class's validation).
    validates_models = True

    def __init__(self, allowlist: Iterable[tuple[str, ...] | type] = ()) -> None:
        self.allowlist: frozenset[tuple[str, ...]] = (
            SAFE_MSGPACK_TYPES
            | _LANGGRAPH_TYPES
            | frozenset(curated_core_allowlist())
            | frozenset(_key(i) for i in allowlist)
        )
        #: The types of the graphs the saver met (`allow`), shared with its copies
        #: (`with_allowlist`): a graph learned by one is known to all.
        self._learned: set[tuple[str, ...]] = set()

    def with_allowlist(self, extra: Iterable[tuple[str, ...] | type]) -> StrictSerializer:
        """A copy that also allows `extra` ((module, name) pairs or classes)."""
        extra_keys = frozenset(_key(i) for i in extra)
        if extra_keys <= self.allowlist | self._learned:
            return self
        clone = copy.copy(self)
        clone.allowlist = self.allowlist | extra_keys
        return clone

    def allow(self, extra: Iterable[tuple[str, ...] | type]) -> None:
        """Also allow `extra` on this serializer and its copies (the types of a graph
        the saver met)."""
        self._learned.update(_key(i) for i in extra)

    def _allows(self, key: tuple[str, str]) -> bool:
        return key in self.allowlist or key in self._learned

    # -- write -------------------------------------------------------------------
    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        return self.dumps_at(obj, "<value>")

    def dumps_at(self, obj: Any, path: str, **ids: Any) -> tuple[str, bytes]:
        """`dumps_typed`, naming `path` (e.g. the channel) and `ids` in a refusal."""
        if obj is None:
            return "null", b""
        if isinstance(obj, bytes):
            return "bytes", obj
        if isinstance(obj, bytearray):
            return "bytearray", bytes(obj)
        self.check(obj, path, **ids)
        try:
            return "msgpack", _encoded(obj)
        except (TypeError, ormsgpack.MsgpackEncodeError) as exc:
            raise CheckpointInvalid(
                f"value at {path} cannot be serialized ({exc}); store plain data or "
                "allowlisted types",
                field=path,
                **ids,
            ) from exc

    def check(self, obj: Any, path: str, **ids: Any) -> None:
        """`CheckpointInvalid` naming the first type in `obj` the allowlist does not name."""
        bad = self._refused(obj)
        if bad is not None:
            steps, cls = bad
            where = path + "".join(reversed(steps))
            why = _unreadable(cls)
            if why is not None:
                raise CheckpointInvalid(
                    f"value of type {cls.__module__}.{cls.__qualname__} at {where} could "
                    f"not be read back as stored: {why}",
                    field=where,
                    **ids,
                )
            raise CheckpointInvalid(
                f"value of type {cls.__module__}.{cls.__qualname__} at {where} is not in the "
                "serializer allowlist; declare it in the graph's state schema or pass "
                "RemitSaver(..., allowlist=[...])",
                field=where,
                **ids,
            )

    def _refused(self, obj: Any) -> tuple[list[str], type] | None:
        """The first object (walking containers and fields) whose type is neither plain
        data nor allowlisted: its path steps, innermost first, and its type."""
        cls: Any = type(obj)
        if cls in _PLAIN_TYPES:
            return None
        items: Any
        if cls is dict:
            if _PLAIN_TYPES.issuperset(map(type, obj)) and _nothing_inside(obj.values()):
                return None
            for k, v in obj.items():
                if type(k) in _PLAIN_TYPES and (
                    type(v) in _PLAIN_TYPES or (not v and type(v) in _EMPTY_FINE)
                ):
                    continue  # the common case, without a call
                bad = None if type(k) in _PLAIN_TYPES else self._refused(k)
                if bad is None:
                    bad = self._refused(v)
                if bad is not None:
                    bad[0].append(f".{k}" if type(k) is str else f"[{k!r}]")
                    return bad
            return None
        if cls in _CONTAINERS:
            if _nothing_inside(obj):
                return None
            items = enumerate(obj)
        else:
            kind = _kind(cls)
            if kind is _Kind.PLAIN:
                return None  # subclasses of plain types; errors are stored as their repr
            if not self._allows((cls.__module__, cls.__name__)) or _unreadable(cls):
                return [], cls
            if kind is _Kind.MODEL:
                fields = vars(obj)
                if _nothing_inside(fields.values()):
                    return None
                items = fields.items()
            elif kind is _Kind.DATACLASS:
                items = ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
            elif kind is _Kind.SEQUENCE:
                items = enumerate(obj)
            elif hasattr(obj, "arg") and hasattr(obj, "node"):  # Send
                items = (("arg", obj.arg),)
            else:
                return None
        for step, value in items:
            if type(value) in _PLAIN_TYPES or (not value and type(value) in _EMPTY_FINE):
                continue
            bad = self._refused(value)
            if bad is not None:
                bad[0].append(f"[{step}]" if isinstance(step, int) else f".{step}")
                return bad
        return None

    # -- read --------------------------------------------------------------------
    @contextlib.contextmanager
    def noting(self) -> Iterator[dict[int, tuple[Any, dict[str, Any] | None]]]:
        """Within it, each Pydantic model this thread's `loads_typed` rebuilds (each
        validated by its class as it is rebuilt) is noted by its id, with the fields
        it was rebuilt from as stored (None where they hold extension types)."""
        noted: dict[int, tuple[Any, dict[str, Any] | None]] = {}
        outer, _noted.into = getattr(_noted, "into", None), noted
        try:
            yield noted
        finally:
            _noted.into = outer

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        type_, body = data
        if type_ == "null":
            return None
        if type_ == "bytes":
            return bytes(body)
        if type_ == "bytearray":
            return bytearray(body)
        if type_ == "msgpack":
            try:
                return ormsgpack.unpackb(body, ext_hook=self._ext_hook, option=_OPTIONS)
            except CorruptRecord:
                raise
            except Exception as exc:
                refusal = getattr(_refusals, "last", None)
                _refusals.last = None
                if refusal is not None:  # raised in the ext hook; msgpack drops the cause
                    raise refusal from None
                raise CorruptRecord(f"stored value does not decode: {exc}") from exc
        raise CorruptRecord(
            f"stored value has serialization type {type_!r}; Remit reads only null, bytes, "
            "bytearray and msgpack (never pickle)"
        )

    def _allowed(self, module: str, name: str) -> None:
        if not self._allows((module, name)):
            raise CorruptRecord(
                f"stored value has type {module}.{name}, which is not in the serializer "
                "allowlist; add it with RemitSaver(..., allowlist=[...]) if it is trusted"
            )

    def _ext_hook(self, code: int, data: bytes) -> Any:
        try:
            return self._rebuild(code, data)
        except CorruptRecord as exc:
            _refusals.last = exc
            raise

    def _rebuild(self, code: int, data: bytes) -> Any:
        if code == jsonplus.EXT_DELTA_SNAPSHOT:
            value = ormsgpack.unpackb(data, ext_hook=self._ext_hook, option=_OPTIONS)
            return jsonplus._DeltaSnapshot(value)  # type: ignore[attr-defined]
        if code == jsonplus.EXT_NUMPY_ARRAY:
            self._allowed("numpy", "ndarray")
            return jsonplus._create_msgpack_ext_hook(True)(code, data)
        tup = ormsgpack.unpackb(data, ext_hook=self._ext_hook, option=_OPTIONS)
        module, name = tup[0], tup[1]
        if code == jsonplus.EXT_METHOD_SINGLE_ARG:
            if (module, name, tup[3]) not in SAFE_MSGPACK_METHODS:
                raise CorruptRecord(f"stored value calls {module}.{name}.{tup[3]}, not allowed")
        else:
            self._allowed(module, name)
        try:
            target = _resolved(module, name)
            if code == jsonplus.EXT_CONSTRUCTOR_SINGLE_ARG:
                return target(tup[2])
            if code == jsonplus.EXT_CONSTRUCTOR_POS_ARGS:
                if (module, name) == ("langgraph.types", "Send"):
                    return jsonplus._send_from_args(tup[2])
                return target(*tup[2])
            if code == jsonplus.EXT_PYDANTIC_V2 and isinstance(target, type(BaseModel)):
                model = _model_from_dump(target, tup[2])
                noted = getattr(_noted, "into", None)
                if noted is not None:
                    noted[id(model)] = (model, _stored_fields(model, data))
                return model
            if code in (
                jsonplus.EXT_CONSTRUCTOR_KW_ARGS,
                jsonplus.EXT_PYDANTIC_V1,
                jsonplus.EXT_PYDANTIC_V2,
            ):
                return target(**tup[2])
            if code == jsonplus.EXT_METHOD_SINGLE_ARG:
                return getattr(target, tup[3])(tup[2])
        except Exception as exc:
            raise CorruptRecord(
                f"stored value of type {module}.{name} does not rebuild: {exc}"
            ) from exc
        raise CorruptRecord(f"stored value has unknown extension code {code}")


def _resolved(module: str, name: str) -> Any:
    """The object `name` of module `module` (allowlisted by the caller), importing the
    module only if it is not loaded: a checkpoint of a long chat rebuilds hundreds of
    messages of a few classes. (Looked up each time: a class redefined, as in a
    notebook, is the new one.)"""
    loaded = sys.modules.get(module)
    return getattr(importlib.import_module(module) if loaded is None else loaded, name)


@functools.lru_cache(maxsize=1024)
def _computed_fields(model: Any) -> frozenset[str]:
    return frozenset(model.model_computed_fields)


@functools.lru_cache(maxsize=1024)
def _by_keywords(model: Any) -> bool:
    """Whether `model(**fields)` validates a dump as `model_validate(dump, by_name=True)`
    does: no field is known by an alias, and the model is not a root model."""
    if issubclass(model, RootModel):
        return False
    return all(
        field.alias in (None, name) and field.validation_alias in (None, name)
        for name, field in model.model_fields.items()
    )


def _model_from_dump(model: Any, dump: Any) -> Any:
    """A Pydantic model, validated, from LangGraph's `model_dump()` of it: fields by
    name (whatever the aliases), and the computed fields the dump also holds left out."""
    computed = _computed_fields(model)
    if computed and isinstance(dump, dict):
        dump = {k: v for k, v in dump.items() if k not in computed}
    if type(dump) is dict and _by_keywords(model):
        return model(**dump)
    return model.model_validate(dump, by_name=True)


def _stored_fields(model: BaseModel, data: bytes) -> dict[str, Any] | None:
    """The fields `model` was rebuilt from (`data`, its extension payload), decoded
    afresh so that they share nothing with it, its computed fields left out; None
    where they hold extension types (a nested model, a datetime)."""
    try:
        fields = ormsgpack.unpackb(data, option=_OPTIONS)[2]
    except Exception:  # noqa: BLE001 (an extension type needs the hook)
        return None
    if not isinstance(fields, dict):
        return None
    computed = _computed_fields(model.__class__)
    return {k: v for k, v in fields.items() if k not in computed} if computed else fields


def _is_pickle(type_: str) -> bool:
    """Whether a serializer's type tag says pickle (alone, or wrapped: `pickle+aes`)."""
    return type_.split("+", 1)[0] == "pickle"


class GuardedSerializer(StrictSerializer):
    """A serializer the user passed (`serde=`, e.g. LangGraph's `EncryptedSerializer`),
    held to the same rules: the allowlist at write time, and pickle never, neither
    stored nor loaded. The encoding itself is the user's serializer's, but LangGraph's
    `JsonPlusSerializer` inside it (itself, or the `serde` of a wrapper such as
    `EncryptedSerializer`) reads fail-closed, as Remit's own serializer does: left to
    itself it rebuilds any importable callable a stored value names (a value written
    into the store by hand runs code), and `EncryptedSerializer` hands it a value that
    is not encrypted as it stands, so the key does not stop that either."""

    #: The user's serializer rebuilds models its own way.
    validates_models = False

    def __init__(
        self, inner: SerializerProtocol, allowlist: Iterable[tuple[str, ...] | type] = ()
    ) -> None:
        super().__init__(allowlist)
        self.inner = inner

    def dumps_at(self, obj: Any, path: str, **ids: Any) -> tuple[str, bytes]:
        self.check(obj, path, **ids)
        typed = self.inner.dumps_typed(obj)
        if _is_pickle(typed[0]):
            raise CheckpointInvalid(
                f"the serializer stored the value at {path} with pickle ({typed[0]!r}); "
                "Remit never stores pickle",
                field=path,
                **ids,
            )
        return typed

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        if _is_pickle(data[0]):
            raise CorruptRecord(
                f"stored value has serialization type {data[0]!r}; Remit never loads pickle"
            )
        return _reading(self.inner, self).loads_typed(data)


class _StrictReads(SerializerProtocol):
    """LangGraph's `JsonPlusSerializer` as a `GuardedSerializer` reads through it: each
    extension type a msgpack value names is vetted first, against the guard's allowlist
    or as a data type (`_data_type`): else `CorruptRecord`, and nothing is built. Then
    the value is the user's serializer's to rebuild, its own way (it does not validate
    models)."""

    def __init__(self, inner: SerializerProtocol, guard: GuardedSerializer) -> None:
        self.inner = inner
        self.guard = guard

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        return self.inner.dumps_typed(obj)

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        if data[0] == "msgpack":
            try:
                ormsgpack.unpackb(data[1], ext_hook=self._vet, option=_OPTIONS)
            except Exception as exc:
                refusal = getattr(_refusals, "last", None)
                _refusals.last = None
                if refusal is not None:  # (msgpack drops the hook's error as a cause)
                    raise refusal from None
                raise CorruptRecord(f"stored value does not decode: {exc}") from exc
        return self.inner.loads_typed(data)

    def _vet(self, code: int, data: bytes) -> None:
        """The allowlist's word on one extension type (and those nested in it)."""
        try:
            if code == jsonplus.EXT_DELTA_SNAPSHOT:
                ormsgpack.unpackb(data, ext_hook=self._vet, option=_OPTIONS)
            elif code == jsonplus.EXT_NUMPY_ARRAY:
                self.guard._allowed("numpy", "ndarray")
            else:
                tup = ormsgpack.unpackb(data, ext_hook=self._vet, option=_OPTIONS)
                module, name = tup[0], tup[1]
                if code != jsonplus.EXT_METHOD_SINGLE_ARG:
                    if not _data_type(module, name):
                        self.guard._allowed(module, name)
                elif (module, name, tup[3]) not in SAFE_MSGPACK_METHODS:
                    raise CorruptRecord(f"stored value calls {module}.{name}.{tup[3]}, not allowed")
        except CorruptRecord as exc:
            _refusals.last = exc
            raise


def _data_type(module: str, name: str) -> bool:
    """Whether `module.name` is a data type of a module already loaded (a Pydantic
    model, a dataclass, an enum): rebuilding one runs only its own validation. What
    the user's serializer may rebuild beyond the allowlist: never a function or any
    other class (a stored value naming `os.system` would run a command), and never by
    importing a module a stored value names."""
    loaded = sys.modules.get(module)
    target = None if loaded is None else getattr(loaded, name, None)
    return isinstance(target, type) and (
        issubclass(target, (BaseModel, enum.Enum)) or dataclasses.is_dataclass(target)
    )


def _reading(inner: SerializerProtocol, guard: GuardedSerializer) -> SerializerProtocol:
    """`inner` with each `JsonPlusSerializer` in it (itself, or a wrapper's `serde`, at
    any depth) reading fail-closed (`_StrictReads`); a serializer of another kind reads
    its own way (its pickle is refused all the same)."""
    if isinstance(inner, jsonplus.JsonPlusSerializer):
        return _StrictReads(inner, guard)
    wrapped = getattr(inner, "serde", None)
    if wrapped is None or not callable(getattr(wrapped, "loads_typed", None)):
        return inner
    clone = copy.copy(inner)
    clone.serde = _reading(wrapped, guard)  # type: ignore[attr-defined]
    return clone
